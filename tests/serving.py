"""Helpers for tests that run pagedserve's command line or start it as a server."""
import asyncio
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import aiohttp

from pagedserve.entrypoints import cli

# The name `pagedserve serve` gives the default model.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_health(http: aiohttp.ClientSession, base: str, status: int, timeout: float = 120) -> None:
    """Returns once the gateway at `base` answers /health with `status`."""
    deadline = time.monotonic() + timeout
    while True:
        async with http.get(f"{base}/health") as r:
            if r.status == status:
                return
        assert time.monotonic() < deadline, f"/health never answered {status}"
        await asyncio.sleep(0.1)


def wait_http(url: str, process: subprocess.Popen, timeout: float, context: ssl.SSLContext | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"pagedserve serve exited with {process.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=1, context=context) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} not ready in {timeout} s")


def wait_uds(path: str, process: subprocess.Popen, timeout: float) -> None:
    """Returns once the gateway on the Unix socket at `path` answers /health with 200."""
    from pagedserve.gateway import uds
    deadline = time.monotonic() + timeout
    while not uds.health_ok(path):
        assert process.poll() is None, f"pagedserve exited with {process.returncode}"
        assert time.monotonic() < deadline, f"no /health on {path} in {timeout} s"
        time.sleep(0.2)


def run_cli(argv: list[str]) -> None:
    # Not cli.main: its logging setup would bind structlog to this test's captured stderr, which
    # pytest closes afterwards, failing every later test that logs.
    args = cli.build_parser().parse_args(argv)
    args.run(args)


@contextmanager
def pagedserve(argv: list[str], ready: Callable[[], bool], timeout: float = 180,
               **popen) -> Iterator[subprocess.Popen]:
    """`python -m pagedserve <argv>` once `ready()` holds; killed at the end if still running."""
    with pagedserve_many([(argv, ready)], timeout, **popen) as processes:
        yield processes[0]


@contextmanager
def pagedserve_many(services: list[tuple[list[str], Callable[[], bool]]], timeout: float = 180,
                    **popen) -> Iterator[list[subprocess.Popen]]:
    """`python -m pagedserve <argv>` of each (argv, ready) pair, started together, once every `ready()`
    holds; those still running are killed at the end."""
    processes = []
    try:
        for argv, _ in services:
            processes.append(subprocess.Popen([sys.executable, "-m", "pagedserve", *argv], **popen))
        deadline = time.monotonic() + timeout
        for (argv, ready), process in zip(services, processes):
            while not ready():
                assert process.poll() is None, f"pagedserve {argv[0]} exited with {process.returncode}"
                assert time.monotonic() < deadline, f"pagedserve {argv[0]} not ready in {timeout} s"
                time.sleep(0.2)
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
