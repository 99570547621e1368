"""API keys: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every route except an
explicit allowlist of exact paths."""
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
    bearer = _matches(token, expected) and scheme.lower() == "bearer"
    # The anthropic SDK (and Claude Code with ANTHROPIC_API_KEY) sends the key this way.
    return _matches(request.headers.get("x-api-key", ""), expected) or bearer


def _matches(sent: str, expected: bytes) -> bool:
    # aiohttp decodes headers with surrogateescape; encoding the same way restores the sent bytes.
    # compare_digest's time does not depend on where the two differ, so the key cannot be guessed by timing.
    return hmac.compare_digest(sent.strip().encode("utf-8", "surrogateescape"), expected)
