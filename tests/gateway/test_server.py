"""The gateway as its own process: flags, readiness, and a SIGTERM that lets in-flight streams finish."""
import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager

import aiohttp
import pytest

from pagedserve.common.service import TOKEN_ENV
from pagedserve.gateway.server import add_gateway_args, api_key


@pytest.fixture(autouse=True)
def no_grpc_token_left_behind(monkeypatch):
    # `serve` gives its children a gRPC token through this process's environment: the tests that run
    # its argument handling in this process must not leave one to the tests after them. Set first, so
    # that monkeypatch records (and restores) the variable's state before the test, absent or not.
    monkeypatch.setenv(TOKEN_ENV, os.environ.get(TOKEN_ENV, ""))
    monkeypatch.delenv(TOKEN_ENV)


def test_flags_and_defaults():
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    args = parser.parse_args([])
    assert (args.host, args.port, args.scheduler_address) == ("127.0.0.1", 8000, "127.0.0.1:50051")
    assert args.tokenizer is None and args.served_model_name is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_healthy(http: aiohttp.ClientSession, url: str, process) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert process.returncode is None
        try:
            async with http.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(url)


@asynccontextmanager
async def gateway_process(http: aiohttp.ClientSession, engine, tokenizer_dir, *flags: str):
    """`pagedserve gateway` on the fake engine, served name "served": (base URL, process) once healthy."""
    port = _free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pagedserve", "gateway", str(tokenizer_dir), "--port", str(port),
        "--scheduler-address", engine.address, "--served-model-name", "served", "--log-level", "warning",
        *flags)
    try:
        url = f"http://127.0.0.1:{port}"
        await _wait_healthy(http, f"{url}/health", process)
        yield url, process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_sigterm_drains_in_flight_stream(engine, tokenizer_dir, http):
    async with gateway_process(http, engine, tokenizer_dir) as (url, process):
        engine.delay = 0.02
        body = {"model": "served", "prompt": "Hi", "max_tokens": 30, "stream": True}
        async with http.post(f"{url}/v1/completions", json=body) as r:
            await r.content.readuntil(b"\n\n")
            process.send_signal(signal.SIGTERM)
            rest = (await r.read()).decode()
        assert rest.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in rest
        assert await asyncio.wait_for(process.wait(), 10) == 0


def launches(monkeypatch) -> list[dict]:
    """The launcher's start_executors and serve replaced, so that `serve` starts no process: each
    start's arguments by name, appended as it is served."""
    from pagedserve.entrypoints import launcher

    calls = []

    def start_executors(_, model, argv, data_parallel_size=1, tensor_parallel_size=1):
        calls.append(dict(executor=argv, data_parallel_size=data_parallel_size))
        return []

    def serve(started, engines, model, argv, listener, scheduler_addresses, startup_timeout, api_key=None,
              also=(), https=False):
        listener.close()
        started.stop()
        calls[-1].update(argv=argv, scheduler_addresses=scheduler_addresses, api_key=api_key,
                         shutdown_timeout=started.shutdown_timeout)
        return 0
    monkeypatch.setattr(launcher, "start_executors", start_executors)
    monkeypatch.setattr(launcher, "serve", serve)
    return calls


def test_serve_passes_access_flags_and_keeps_the_key_out_of_argv(monkeypatch, tmp_path):
    from pagedserve.common.model_shapes import write_shape
    from pagedserve.entrypoints import cli

    calls = launches(monkeypatch)
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    model = write_shape("llama-3.1-8b", str(tmp_path))
    assert cli.main(["serve", model, "--port", "0", "--api-key", "sk-secret", "--protect-metrics",
                     "--allowed-origins", "https://a.example,https://b.example", "--allowed-hosts", "a.example",
                     "--trust-request-chat-template"]) == 0
    gateway_argv, key = calls[0]["argv"]["gateway"], calls[0]["api_key"]
    assert "sk-secret" not in " ".join(gateway_argv) and key == "sk-secret"
    assert "PAGEDSERVE_API_KEY" not in os.environ
    # The launcher gives the gateway the key in its environment.
    monkeypatch.setenv("PAGEDSERVE_API_KEY", key)
    parsed = cli.build_parser().parse_args(["gateway", model, *gateway_argv])
    assert api_key(parsed) == "sk-secret" and parsed.protect_metrics and parsed.trust_request_chat_template
    assert parsed.allowed_origins == ["https://a.example", "https://b.example"]
    assert parsed.allowed_hosts == ["a.example"]


def test_serve_passes_the_reliability_flags_to_their_owners(monkeypatch, tmp_path):
    from pagedserve.common.model_shapes import write_shape
    from pagedserve.entrypoints import cli

    calls = launches(monkeypatch)
    model = write_shape("llama-3.1-8b", str(tmp_path))
    assert cli.main(["serve", model, "--port", "0", "--shutdown-timeout", "7", "--max-num-queued-reqs", "3",
                     "--max-client-batch-size", "64", "--timeout-keep-alive", "9",
                     "--body-read-timeout", "11", "--max-concurrent-requests", "5"]) == 0
    argv, shutdown_timeout = calls[0]["argv"], calls[0]["shutdown_timeout"]
    gateway = cli.build_parser().parse_args(["gateway", model, *argv["gateway"]])
    assert (gateway.shutdown_timeout, gateway.max_client_batch_size, gateway.max_concurrent_requests) == (7, 64, 5)
    assert (gateway.timeout_keep_alive, gateway.body_read_timeout) == (9, 11)
    scheduler = cli.build_parser().parse_args(["scheduler", model, *argv["scheduler"]])
    assert scheduler.max_num_queued_reqs == 3 and shutdown_timeout == 7


def test_serve_data_parallel_gives_the_launcher_one_address_per_engine(monkeypatch, tmp_path, capsys):
    from pagedserve.common.model_shapes import write_shape
    from pagedserve.entrypoints import cli

    calls = launches(monkeypatch)
    model = write_shape("llama-3.1-8b", str(tmp_path))
    assert cli.main(["serve", model, "--port", "0", "-dp", "2", "--scheduler-address", "127.0.0.1:1,127.0.0.1:2"]) == 0
    assert calls[0]["scheduler_addresses"] == ["127.0.0.1:1", "127.0.0.1:2"] and calls[0]["data_parallel_size"] == 2
    assert cli.main(["serve", model, "--port", "0", "-dp", "2", "--scheduler-address", "127.0.0.1:1"]) == 1
    assert "lists 1 addresses for --data-parallel-size 2; list one per engine" in capsys.readouterr().err


def test_each_engine_gets_its_own_gpus():
    from pagedserve.entrypoints.launcher import engine_devices

    assert engine_devices(2, 1, None) == ["0", "1"]
    assert engine_devices(2, 2, "4,5,6,7") == ["4,5", "6,7"]
    with pytest.raises(ValueError, match="needs 4 GPUs but CUDA_VISIBLE_DEVICES=0,1 lists 2"):
        engine_devices(2, 2, "0,1")


@pytest.mark.parametrize("value, says", [("127.0.0.1:1,,127.0.0.1:2", "has an empty entry"),
                                         ("127.0.0.1:1,127.0.0.1:1", "lists an address twice")])
def test_gateway_refuses_a_bad_scheduler_list(capsys, value, says):
    from pagedserve.entrypoints import cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["gateway", "--scheduler-address", value])
    assert says in capsys.readouterr().err
