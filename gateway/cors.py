"""CORS for browser clients, with vLLM's flags: preflights answered before authentication, allowed
origins echoed, methods and headers limited when the flags say so, credentials when allowed."""
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from pagedserve.gateway.errors import APIError
from pagedserve.gateway.request_id import HEADER

# Every method a route of this server takes.
_METHODS = ("GET", "POST", "DELETE", "OPTIONS")


@dataclass(slots=True)
class CorsRules:
    """--allowed-origins (exact origins, or "*" for any), --allowed-methods and --allowed-headers
    ("*": any), and --allow-credentials."""
    origins: Sequence[str]
    methods: Sequence[str] = ("*",)
    headers: Sequence[str] = ("*",)
    credentials: bool = False


class CORS:
    def __init__(self, rules: CorsRules) -> None:
        self._any = "*" in rules.origins
        self._origins = frozenset(rules.origins)
        self._methods = _METHODS if "*" in rules.methods else tuple(m.upper() for m in rules.methods)
        self._headers = None if "*" in rules.headers else frozenset(h.lower() for h in rules.headers)
        self._credentials = rules.credentials

    def _allowed(self, origin: str) -> bool:
        return self._any or origin in self._origins

    @web.middleware
    async def preflight(self, request: web.Request, handler) -> web.StreamResponse:
        """Answers preflights itself: without a body, without the API key (browsers never send it)."""
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        if not self._allowed(request.headers.get("Origin", "")):
            raise APIError(403, "This origin may not call the API: start the server with "
                           "--allowed-origins listing it.", code="origin_not_allowed")
        method = request.headers["Access-Control-Request-Method"].upper()
        if method not in self._methods:
            raise APIError(403, f"Browsers may not send {method[:16]} requests here: start the server with "
                           "--allowed-methods listing it.", code="method_not_allowed")
        asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
        refused = [h for h in asked if self._headers is not None and h.lower() not in self._headers]
        if refused:
            raise APIError(403, f"Browsers may not send the header {refused[0][:64]!r} here: start the server "
                           "with --allowed-headers listing it.", code="header_not_allowed")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": ", ".join(self._methods),
            # SDKs add headers of their own (x-stainless-*): under "*" whatever the browser asks for.
            "Access-Control-Allow-Headers": ", ".join(asked),
            "Access-Control-Max-Age": "600",
        })

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Adds the CORS headers to every response, streams included, for an allowed Origin."""
        origin = request.headers.get("Origin")
        if origin is None or not self._allowed(origin):
            return
        response.headers.update(self._origin_headers(origin))
        response.headers["Access-Control-Expose-Headers"] = HEADER

    def _origin_headers(self, origin: str) -> dict[str, str]:
        # Browsers refuse "*" on a request with credentials: then the origin itself is echoed.
        echoed = origin if self._credentials or not self._any else "*"
        headers = {"Access-Control-Allow-Origin": echoed, "Vary": "Origin"}
        if self._credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers
