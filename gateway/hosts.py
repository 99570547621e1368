"""The Host headers a gateway answers. One that listens on a loopback address answers only loopback
names (and --allowed-hosts): otherwise a web page the user opens could reach it through DNS
rebinding (its own name re-pointed at 127.0.0.1), as Ollama's CVE-2024-28224 did."""
import ipaddress

from aiohttp import web
from aiohttp.typedefs import Middleware

from pagedserve.gateway.errors import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address or a name) is this machine only."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str | None, extra: list[str]) -> frozenset[str] | None:
    """The Host names to answer, None for any: on a loopback address the loopback names, the
    address itself and `extra`; elsewhere, and on a Unix socket (bind_host None), which no web page
    can reach, `extra` only, and any when it is empty or holds "*"."""
    names = frozenset(_name(h) for h in extra)
    if "*" in names:
        return None
    if bind_host is not None and is_loopback(bind_host):
        address = f"[{bind_host}]" if ":" in bind_host else bind_host
        return LOOPBACK_NAMES | names | {_name(address)}
    return names or None


def host_middleware(allowed: frozenset[str]) -> Middleware:
    """Answers 421 to a request whose Host header names none of `allowed` (any port)."""

    @web.middleware
    async def check_host(request: web.Request, handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if host is not None and _name(host) not in allowed:
            raise APIError(421, f"This server does not answer requests for the host {host[:100]!r}: it "
                           "listens on a loopback address and answers its loopback names only. Send the "
                           "request to one, or start the server with --allowed-hosts naming this host.",
                           code="misdirected_request")
        return await handler(request)

    return check_host


def _name(host: str) -> str:
    """A Host header's name, lowercased, without its port or a trailing dot: "[::1]:8000" -> "[::1]"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1]
    if host.count(":") == 1:
        host = host.split(":")[0]
    return host.rstrip(".")
