"""Request ids: the client's X-Request-Id or a new one, bound to every log line, echoed exactly once."""
import re
from collections.abc import Iterator
from contextlib import contextmanager
import uuid
from contextvars import ContextVar

import structlog
from aiohttp import web

HEADER = "X-Request-Id"
# Incoming ids go into a response header and gRPC metadata, so only short printable ASCII is kept.
_VALID = re.compile(r"[\x21-\x7e]{1,128}")
_current: ContextVar[str] = ContextVar("request_id")


def current_request_id() -> str:
    return _current.get()


@contextmanager
def bound_request_id(request_id: str, **log_fields) -> Iterator[None]:
    """`request_id` as the current one, and on every log line with `log_fields`, until the block ends."""
    # Reset on exit: requests on one keep-alive connection run in the same task.
    token = _current.set(request_id)
    try:
        with structlog.contextvars.bound_contextvars(request_id=request_id, **log_fields):
            yield
    finally:
        _current.reset(token)


@web.middleware
async def request_id_middleware(request: web.Request, handler) -> web.StreamResponse:
    incoming = request.headers.get(HEADER, "")
    request_id = incoming if _VALID.fullmatch(incoming) else uuid.uuid4().hex
    with bound_request_id(request_id):
        response = await handler(request)
    # A stream sets the header itself, before its headers go out.
    if not response.prepared:
        response.headers[HEADER] = request_id
    return response
