"""Errors in OpenAI's shape (another protocol's on its paths) and the middleware that answers every failure."""
import asyncio
from collections.abc import Callable

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from pagedserve.common.log import get_logger, loggable

log = get_logger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error for the client: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(what: str, param: str) -> APIError:
    return bad_request(f"{what} is not supported yet; remove `{param}` from the request.", param=param)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def request_timeout(seconds: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {seconds:g} s; send it faster, or start "
                    "the server with a longer --body-read-timeout.", code="request_timeout")


class Unavailable(APIError):
    """A 503 the client may retry: the SDK retries 503 and honours Retry-After."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(503, message, type="service_unavailable", code=code, headers={"Retry-After": "1"})


def unavailable(message: str) -> APIError:
    return Unavailable(message)


def overloaded(message: str = "The server is overloaded; retry shortly.") -> APIError:
    return Unavailable(message, code="server_overloaded")


def unauthorized() -> APIError:
    return APIError(401, "Missing or incorrect API key: send it as the header `Authorization: Bearer "
                    "<key>` (or `x-api-key: <key>`), with the key the server was started with (--api-key or "
                    "PAGEDSERVE_API_KEY).",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def internal(message: str = "The server had an error while processing your request.") -> APIError:
    return APIError(500, message, type="internal_server_error", headers={"x-should-retry": "false"})


_encoder = msgspec.json.Encoder()

# Statuses aiohttp raises itself (routing, body size, methods) with messages that tell the client what to do.
_HTTP_MESSAGES = {
    404: "Not found: this server serves /v1/models, /v1/completions, /v1/chat/completions, /v1/responses, "
         "/v1/messages, /v1/embeddings, /v1/files, /v1/batches, /rerank, /v1/rerank, /v2/rerank, /score, /v1/score, Ollama's /api/chat, "
         "/api/generate, /api/embed, /api/embeddings, /api/tags, /api/show, /api/ps and /api/version, /tokenize, "
         "/detokenize, /version, /load, /health and /metrics.",
    405: "Method not allowed on this path.",
    413: f"Request body too large: the limit is {MAX_BODY_BYTES} bytes.",
}


def encode_error(error: APIError) -> bytes:
    return _encoder.encode(ErrorBody(error=error.info))


# An error's body in one protocol's shape.
ErrorEncoder = Callable[[APIError], bytes]


def error_response(error: APIError, encode: ErrorEncoder = encode_error) -> web.Response:
    return web.Response(status=error.status, body=encode(error), content_type="application/json",
                        headers=error.headers)


def _from_http(exc: web.HTTPException) -> APIError:
    message = _HTTP_MESSAGES.get(exc.status, exc.reason)
    kind = "invalid_request_error" if exc.status < 500 else "internal_server_error"
    return APIError(exc.status, message, type=kind)


def error_middleware(shapes: dict[str, ErrorEncoder]) -> Middleware:
    """Answers every exception with an error body, in the shape of the protocol whose path prefix (a
    key of `shapes`) the path starts with, else OpenAI's; never leaks a traceback."""
    @web.middleware
    async def answer_errors(request: web.Request, handler) -> web.StreamResponse:
        encode = next((e for prefix, e in shapes.items() if request.path.startswith(prefix)), encode_error)
        try:
            return await handler(request)
        except APIError as e:
            # The message may quote what the client sent.
            log.info("request_failed", status=e.status, message=loggable(e.info.message))
            return error_response(e, encode)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error_response(_from_http(e), encode)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("request_crashed")
            return error_response(internal(), encode)

    return answer_errors
