"""Child processes that must not outlive the process that started them."""
import ctypes
import signal
import sys


def die_with_parent() -> None:
    """Asks Linux to SIGTERM this process when the thread that started it ends: a preexec_fn for
    subprocess.Popen, so that a child dies with its parent even if the parent is killed."""
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
