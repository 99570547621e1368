"""What `pagedserve serve` checks before it starts any process: the model's path and config (its
config.json or GGUF metadata), and the gateway's port, which it binds at once so that no other
server can take it while the model loads. None of it loads weights, so a bad start fails in
seconds, in one line."""
import errno
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

# owner/name, as Hugging Face writes model ids.
HF_ID = re.compile(r"[\w.-]+/[\w.-]+")
LAYOUT = "a model directory holding config.json (and *.safetensors, tokenizer.json) or a .gguf file"


def check_model(path: str, max_model_len: int | None) -> None:
    """Raises ValueError when `path` is no model pagedserve can serve at `max_model_len`."""
    model = Path(path)
    if not model.exists():
        if HF_ID.fullmatch(path) and not path.startswith("."):
            raise ValueError(f"{path} is not a local path; pagedserve never downloads models: pass a "
                             "local directory or .gguf file")
        raise ValueError(f"{path} does not exist: pass {LAYOUT}")
    if model.is_file() and model.suffix != ".gguf":
        raise ValueError(f"{path} is a file but not a .gguf file: pass {LAYOUT}")
    if model.is_dir() and not (model / "config.json").is_file():
        ggufs = sorted(model.glob("*.gguf"))
        if len(ggufs) != 1:
            found = (f"and {len(ggufs)} .gguf files, so which to serve is unclear" if ggufs
                     else "nor a .gguf file")
            raise ValueError(f"{path} has no config.json {found}: pass {LAYOUT}")
    # Imported after the checks above: it imports torch (about 2 s on a 2-core machine), which a
    # wrong path, the launcher's other uses of this module and its executors' start need not wait for.
    from pagedserve.executor_svc.model_config import load_model_config, resolve_max_model_len
    resolve_max_model_len(load_model_config(model), max_model_len)


def bind(host: str, port: int) -> socket.socket:
    """The gateway's socket, bound but not listening (connections are refused until the gateway
    serves); raises ValueError naming who holds the port when it is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host} does not resolve ({e.strerror}); pass an address such as "
                         "127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    # As aiohttp sets it: a port whose last connections are in TIME_WAIT is free to bind.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(holder(host, port)) from None
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --host or "
                         "--port") from None
    sock.set_inheritable(True)
    return sock


def holder(host: str, port: int) -> str:
    """Who holds a taken port, as far as its answer to /health tells."""
    try:
        with urllib.request.urlopen(f"http://{connect_host(host)}:{port}/health", timeout=1) as reply:
            server = reply.headers.get("Server", "")
    except urllib.error.HTTPError as e:
        server = e.headers.get("Server", "")
    except OSError:
        server = ""
    if server.startswith("pagedserve/"):
        return (f"another pagedserve ({server}) already serves on {host}:{port}; stop it, or pass "
                "another --port")
    return f"port {port} on {host} is in use by another process; stop it, or pass another --port"


def connect_host(host: str) -> str:
    """The address to reach a server listening on `host` from this machine."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host
