"""Child processes that must not outlive the process that started them."""
import ctypes
import os
import signal
import sys

# Environment variables that hold secrets: only the gateway, which checks the API key, gets them.
SECRET_VARIABLES = frozenset({"PAGEDSERVE_API_KEY"})


def die_with_parent() -> None:
    """Asks Linux to SIGTERM this process when the thread that started it ends: a preexec_fn for
    subprocess.Popen, so that a child dies with its parent even if the parent is killed."""
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def environment_without_secrets() -> dict[str, str]:
    """This process's environment less SECRET_VARIABLES, for a child that needs none of them."""
    return {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES}
