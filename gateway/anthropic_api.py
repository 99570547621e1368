"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, a translator between its
wire and the request plan."""
import msgspec

from pagedserve.gateway.anthropic_schemas import ErrorBody, ErrorInfo
from pagedserve.gateway.errors import APIError

_encoder = msgspec.json.Encoder()
# Anthropic's error type for each status; 529 is its "overloaded", which this server sends as 503.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def encode_error(error: APIError) -> bytes:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return _encoder.encode(ErrorBody(ErrorInfo(kind, error.info.message)))
