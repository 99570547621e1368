"""API keys: `Authorization: Bearer <key>` on every route except an explicit allowlist of exact paths."""
import hmac

from aiohttp import web
from aiohttp.typedefs import Middleware

from pagedserve.gateway.errors import unauthorized


def auth_middleware(api_key: str, open_paths: frozenset[str]) -> Middleware:
    """Answers 401 unless the request carries `api_key`. `open_paths` match exactly: "/health/" or a
    prefix of "/health" is not open."""
    expected = api_key.encode()

    @web.middleware
    async def require_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in open_paths and not _has_key(request, expected):
            raise unauthorized()
        return await handler(request)

    return require_key


def _has_key(request: web.Request, expected: bytes) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    # aiohttp decodes headers with surrogateescape; encoding the same way restores the sent bytes.
    sent = token.strip().encode("utf-8", "surrogateescape")
    # compare_digest's time does not depend on where the two differ, so the key cannot be guessed by timing.
    return hmac.compare_digest(sent, expected) and scheme.lower() == "bearer"
