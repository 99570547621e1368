"""A gateway of its own on a Unix domain socket (--uds) beside the session's server: it binds the
socket itself, answers on it, and removes the socket file when it stops."""
from pathlib import Path

import httpx

from tests.e2e.conftest import start
from tests.serving import DEFAULT_MODEL_NAME, wait_uds


def test_a_gateway_serves_on_its_own_unix_socket(servers, tmp_path):
    path = str(tmp_path / "gateway.sock")
    gateway = start(["gateway", "--uds", path, "--scheduler-address", servers["scheduler"],
                     "--served-model-name", DEFAULT_MODEL_NAME])
    try:
        wait_uds(path, gateway, timeout=120)
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=60) as http:
            # A proxy in front passes its clients' Host on; a Unix socket answers any.
            models = http.get("http://api.example.com/v1/models").json()
            reply = http.post("http://localhost/v1/completions",
                              json={"model": DEFAULT_MODEL_NAME, "prompt": "Hi", "max_tokens": 3}).json()
        assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL_NAME]
        assert reply["usage"]["completion_tokens"] >= 1
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
    assert not Path(path).exists()
