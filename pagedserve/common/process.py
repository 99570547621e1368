"""Child processes that must not outlive the process that started them."""
import ctypes
import os
import signal
import sys

# Environment variables that hold secrets: only the gateway, which checks the API key, gets them.
SECRET_VARIABLES = frozenset({"PAGEDSERVE_API_KEY"})
# Set by the launcher to its pid: the child then asks to die with it (die_with_launcher).
PARENT_PID_ENV = "PAGEDSERVE_DIE_WITH_PARENT"
# Set by the launcher to the read end of a pipe for a child it starts before its own checks end.
START_GATE_ENV = "PAGEDSERVE_START_GATE"


def die_with_parent() -> None:
    """Asks Linux to SIGTERM this process when the thread that started it ends, so that a child
    dies with its parent even if the parent is killed: called in the child, as a Popen
    preexec_fn or at its start (die_with_launcher)."""
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with(parent: int) -> bool:
    """In a child started without a preexec_fn: die_with_parent(), and whether `parent` is still
    this process's parent (if not, it died before the request and the child should exit)."""
    die_with_parent()
    return os.getppid() == parent


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def environment_without_secrets() -> dict[str, str]:
    """This process's environment less SECRET_VARIABLES, for a child that needs none of them."""
    return {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES}


def die_with_launcher() -> None:
    """Called first thing by `python -m pagedserve`: with PARENT_PID_ENV set, die_with_parent(), and
    exit at once if that parent is gone already. Done here after exec, not as a Popen preexec_fn:
    a preexec_fn makes subprocess fork() rather than vfork(), which runs gRPC's fork handlers, and
    in the launcher those deadlock now and then with the thread that shuts gRPC down once a health
    probe's channel closes (the launcher then hangs in Popen, never starting the next child)."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is not None and not die_with(int(parent)):
        os._exit(1)


def pass_start_gate() -> None:
    """In a child the launcher started gated (START_GATE_ENV): waits until the launcher lets it go
    on, and exits quietly if the launcher closes the gate instead (its checks failed, or it died)."""
    fd = os.environ.pop(START_GATE_ENV, None)
    if fd is not None:
        with os.fdopen(int(fd), "rb") as gate:
            if not gate.read(1):
                raise SystemExit(0)
