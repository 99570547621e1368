"""The gateway's Unix domain socket (--uds, as vLLM's): bound before the gateway serves, by
`pagedserve serve` before the model loads as its TCP port is, and removed when serving ends."""
import socket
import stat
from pathlib import Path


def bind_unix(path: str) -> socket.socket:
    """A stream socket bound at `path`, not listening yet. A socket file that no server answers
    on, left by a server that was killed, is replaced; raises ValueError when a server answers
    there or `path` is some other file."""
    file = Path(path)
    if file.is_symlink() or file.exists():
        if not stat.S_ISSOCK(file.lstat().st_mode):
            raise ValueError(f"--uds {path} exists and is not a socket; pass another path")
        if answers(path):
            raise ValueError(f"a server already listens on --uds {path}; stop it, or pass another path")
        file.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on --uds {path} ({e.strerror}); pass another path") from None
    sock.set_inheritable(True)
    return sock


def answers(path: str) -> bool:
    """Whether a server accepts connections on the socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def health_ok(path: str) -> bool:
    """Whether the gateway on the socket at `path` answers GET /health with 200."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1)
        try:
            probe.connect(path)
            probe.sendall(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")
            status = probe.makefile("rb").readline().split()
        except OSError:
            return False
    return status[1:2] == [b"200"]


def remove(path: str) -> None:
    """Removes the socket file at `path`, if it is still there."""
    Path(path).unlink(missing_ok=True)
