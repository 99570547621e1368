"""The real processes the agent-protocol tests share, started once a session: `pagedserve serve` on the
default model with --enable-auto-tool-choice --tool-call-parser hermes, and a second gateway with
--reasoning-parser qwen3 on the same scheduler (starting them takes about 30 s on a CI CPU)."""
import os
import subprocess
import sys

import pytest

from pagedserve.common import service
from tests.serving import DEFAULT_MODEL_NAME, free_port, wait_http


def start(argv: list[str]) -> subprocess.Popen:
    # The second gateway calls serve's scheduler, which requires the token serve was given.
    env = {**os.environ, service.TOKEN_ENV: "e2e-agents-token"}
    return subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", *argv], env=env)


@pytest.fixture(scope="session")
def servers():
    port, reasoning_port, grpc_port = free_port(), free_port(), free_port()
    scheduler = f"127.0.0.1:{grpc_port}"
    serve = start(["serve", "--port", str(port), "--scheduler-address", scheduler, "--max-model-len", "2048",
                   "--num-gpu-blocks-override", "512", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                   "--trust-request-chat-template"])
    processes = [serve]
    try:
        wait_http(f"http://127.0.0.1:{port}/health", serve, timeout=240)
        gateway = start(["gateway", "--port", str(reasoning_port), "--scheduler-address", scheduler,
                         "--served-model-name", DEFAULT_MODEL_NAME, "--reasoning-parser", "qwen3",
                         "--trust-request-chat-template"])
        processes.append(gateway)
        wait_http(f"http://127.0.0.1:{reasoning_port}/health", gateway, timeout=120)
        yield {"tools": f"http://127.0.0.1:{port}", "reasoning": f"http://127.0.0.1:{reasoning_port}",
               "scheduler": scheduler}
    finally:
        for process in processes[::-1]:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="module")
def url(servers):
    """The tool-calling server's base URL, which the protocol tests talk to."""
    return servers["tools"]


@pytest.fixture(scope="module")
def client(url):
    # Imported here: the GPU machine runs this folder's GPU tests without the openai package.
    import openai
    return openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
