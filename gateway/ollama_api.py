"""The Ollama API: /api/chat and /api/generate (NDJSON streams, on by default), /api/tags, /api/show,
/api/ps and /api/version, a translator between Ollama's wire and the request plan."""
import msgspec

from pagedserve.gateway.errors import APIError
from pagedserve.gateway.ollama_schemas import ErrorBody

_encoder = msgspec.json.Encoder()


def encode_error(error: APIError) -> bytes:
    """An error in Ollama's shape: {"error": "<message>"}."""
    return _encoder.encode(ErrorBody(error.info.message))
