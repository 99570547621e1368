"""CORS for browser clients: preflights answered before authentication; allowed origins echoed."""
from aiohttp import web

from pagedserve.gateway.errors import APIError
from pagedserve.gateway.request_id import HEADER

_ALLOW_METHODS = "GET, POST, OPTIONS"


class CORS:
    """`origins` are exact origins ("https://app.example.com"), or "*" for any."""

    def __init__(self, origins: list[str]) -> None:
        self._any = "*" in origins
        self._origins = frozenset(origins)

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
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": _ALLOW_METHODS,
            # SDKs add headers of their own (x-stainless-*), so whatever the browser asks for is allowed.
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", ""),
            "Access-Control-Max-Age": "600",
        })

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Adds the CORS headers to every response, streams included, for an allowed Origin."""
        origin = request.headers.get("Origin")
        if origin is None or not self._allowed(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = "*" if self._any else origin
        response.headers["Access-Control-Expose-Headers"] = HEADER
        response.headers["Vary"] = "Origin"
