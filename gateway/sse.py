"""Server-sent events in OpenAI's framing: `data: <json>\n\n` per event, LF only, `data: [DONE]` last."""
import msgspec
from aiohttp import web

from pagedserve.gateway.errors import APIError, encode_error
from pagedserve.gateway.request_id import HEADER, current_request_id

_encoder = msgspec.json.Encoder()
_PREFIX = b"data: "


class SSEWriter:
    """Writes one stream of events to the client."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> "SSEWriter":
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            # Proxies such as nginx would otherwise buffer the stream.
            "X-Accel-Buffering": "no",
            HEADER: current_request_id(),
        })
        await response.prepare(request)
        return cls(response)

    async def send(self, event: msgspec.Struct) -> None:
        buf = bytearray(_PREFIX)
        _encoder.encode_into(event, buf, len(_PREFIX))
        buf += b"\n\n"
        await self.response.write(buf)

    async def send_error(self, error: APIError) -> None:
        await self.response.write(_PREFIX + encode_error(error) + b"\n\n")

    async def close(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
