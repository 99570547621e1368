"""SEC-10, the gateway's side: a gateway listening beyond loopback without an API key says so at
warning level on every start (it still starts: `docker run IMAGE --model X` must keep working), and
the key may come from a file (a Docker or Kubernetes secret), its final newline dropped."""
import argparse
import asyncio
import sys

import pytest

from pagedserve.gateway.server import add_gateway_args
from tests.gateway.test_server import _free_port, _wait_healthy


async def _start_and_stop(http, engine, tokenizer_dir, *flags: str) -> tuple[str, list[int]]:
    """Starts `pagedserve gateway` on 0.0.0.0 with `flags`, asks /v1/models with and without the key
    "sk-file", stops it; returns its log and the two statuses."""
    port = _free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pagedserve", "gateway", str(tokenizer_dir), "--host", "0.0.0.0", "--port", str(port),
        "--scheduler-address", engine.address, "--log-level", "warning", *flags, stderr=asyncio.subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        await _wait_healthy(http, f"{url}/health", process)
        statuses = []
        for headers in ({}, {"Authorization": "Bearer sk-file"}):
            async with http.get(f"{url}/v1/models", headers=headers) as r:
                statuses.append(r.status)
    finally:
        process.terminate()
        _, log = await process.communicate()
    return log.decode(), statuses


async def test_an_open_gateway_on_every_interface_warns(http, engine, tokenizer_dir, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    log, statuses = await _start_and_stop(http, engine, tokenizer_dir)
    line = next(line for line in log.splitlines() if "unauthenticated_public_bind" in line)
    assert "[warning" in line and "--api-key-file" in line
    assert statuses == [200, 200]


async def test_a_key_from_a_file_closes_it_without_a_warning(http, engine, tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    (tmp_path / "key").write_text("sk-file\n")
    log, statuses = await _start_and_stop(http, engine, tokenizer_dir, "--api-key-file", str(tmp_path / "key"))
    assert "unauthenticated_public_bind" not in log
    assert statuses == [401, 200]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    return parser.parse_args(list(argv))


def test_the_key_is_stripped_and_must_be_one_word(tmp_path, monkeypatch):
    from pagedserve.gateway.server import api_key
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "sk-env\n")
    assert api_key(_args()) == "sk-env"
    assert api_key(_args("--api-key", " sk-flag ")) == "sk-flag"
    (tmp_path / "key").write_text("  sk-file\r\n")
    assert api_key(_args("--api-key-file", str(tmp_path / "key"))) == "sk-file"
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "")
    assert api_key(_args()) is None
    for bad in ("sk one", ""):
        (tmp_path / "key").write_text(bad)
        with pytest.raises(ValueError, match="empty or holds whitespace"):
            api_key(_args("--api-key-file", str(tmp_path / "key")))
    with pytest.raises(ValueError, match="pass one"):
        api_key(_args("--api-key", "a", "--api-key-file", str(tmp_path / "key")))
