"""The launcher's children: SEC-19, `pagedserve serve` gives the API key to the gateway alone (the
scheduler and the executor never see it in their environment); they die with the launcher; a
killed launcher's socket folder is removed by the next; a child started gated waits for its gate."""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from pagedserve.common.process import PARENT_PID_ENV, START_GATE_ENV
from pagedserve.entrypoints.launcher import OWNER_FILE, SOCKET_DIR_PREFIX, Launcher
from tests.gateway.fake_engine import build_tiny_tokenizer
from tests.serving import free_port


def _environ(pid: int) -> dict[str, str]:
    """The child's environment, once it runs pagedserve (until it has exec'd, /proc shows the
    launcher's copy)."""
    deadline = time.monotonic() + 10
    while b"\0pagedserve\0" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, f"child {pid} never ran pagedserve"
        time.sleep(0.05)
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)


def test_only_the_gateway_child_gets_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "sk-inherited")
    build_tiny_tokenizer(tmp_path)
    launcher = Launcher()
    try:
        # Gateways on a dead scheduler: small children that stay up, standing in for any service.
        argv = ["gateway", str(tmp_path), "--scheduler-address", "127.0.0.1:1", "--port"]
        other = launcher.spawn("scheduler", [*argv, str(free_port())])
        gateway = launcher.spawn("gateway", [*argv, str(free_port())], env={"PAGEDSERVE_API_KEY": "sk-gateway"})
        assert "PAGEDSERVE_API_KEY" not in _environ(other.process.pid)
        assert _environ(gateway.process.pid)["PAGEDSERVE_API_KEY"] == "sk-gateway"
    finally:
        launcher.stop()


# A launcher killed outright takes its children with it; they ask for that themselves once they
# run (a Popen preexec_fn would make subprocess fork, and gRPC's fork handlers could hang it).
def test_children_die_with_a_killed_launcher(tmp_path):
    build_tiny_tokenizer(tmp_path)
    script = ("import sys, time; from pagedserve.entrypoints.launcher import Launcher; l = Launcher(); "
              f"c = l.spawn('gateway', ['gateway', {str(tmp_path)!r}, '--scheduler-address', '127.0.0.1:1', "
              f"'--port', '{free_port()}']); print(c.process.pid, flush=True); time.sleep(600)")
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(launcher.stdout.readline()))
    _environ(child.pid)
    launcher.kill()
    launcher.wait()
    child.wait(timeout=30)


def test_a_child_whose_launcher_is_gone_exits_at_once():
    run = subprocess.run([sys.executable, "-m", "pagedserve", "--help"], capture_output=True,
                         env={**os.environ, PARENT_PID_ENV: "1"})
    assert run.returncode == 1 and not run.stdout


def test_a_launcher_removes_the_socket_folders_of_launchers_that_are_gone():
    script = ("import time; from pagedserve.entrypoints.launcher import Launcher; "
              "print(Launcher().socket_dir, flush=True); time.sleep(600)")
    killed = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    gone = Path(killed.stdout.readline().strip())
    killed.kill()
    killed.wait()
    alive = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX))
    (alive / OWNER_FILE).write_text(str(os.getpid()))
    launcher = Launcher()
    try:
        assert gone.parent == alive.parent and not gone.exists() and alive.exists()
    finally:
        launcher.stop()
        shutil.rmtree(alive)


@pytest.mark.parametrize("opened", [True, False], ids=["opened", "closed"])
def test_a_gated_child_goes_on_only_once_its_gate_opens(opened):
    read, write = os.pipe()
    script = "from pagedserve.common.process import pass_start_gate; pass_start_gate(); print('went on')"
    child = subprocess.Popen([sys.executable, "-c", script], pass_fds=(read,),
                             env={**os.environ, START_GATE_ENV: str(read)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    os.close(read)
    if opened:
        os.write(write, b"1")
    os.close(write)
    out, err = child.communicate(timeout=60)
    assert (child.returncode, out, err) == (0, "went on\n" if opened else "", "")
