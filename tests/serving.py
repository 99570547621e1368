"""Helpers for tests that run pagedserve's command line or start it as a server."""
import socket
import subprocess
import time
import urllib.request

from pagedserve.entrypoints import cli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"pagedserve serve exited with {process.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} not ready in {timeout} s")


def run_cli(argv: list[str]) -> None:
    # Not cli.main: its logging setup would bind structlog to this test's captured stderr, which
    # pytest closes afterwards, failing every later test that logs.
    args = cli.build_parser().parse_args(argv)
    args.run(args)
