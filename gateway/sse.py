"""Server-sent events in OpenAI's framing: `data: <json>\n\n` per event, LF only, `data: [DONE]` last.
Named (the Responses and Anthropic APIs' framing): `event: <type>\n` before each event's data, the
type being its Struct's tag, and no `[DONE]`."""
import msgspec
from aiohttp import web

from pagedserve.gateway.request_id import HEADER, current_request_id

_encoder = msgspec.json.Encoder()
_PREFIX = b"data: "


class SSEWriter:
    """Writes one stream of events to the client."""

    def __init__(self, response: web.StreamResponse, named: bool = False) -> None:
        self.response = response
        self.named = named

    @classmethod
    async def open(cls, request: web.Request, named: bool = False) -> "SSEWriter":
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            # Proxies such as nginx would otherwise buffer the stream.
            "X-Accel-Buffering": "no",
            HEADER: current_request_id(),
        })
        await response.prepare(request)
        return cls(response, named)

    async def send(self, event: msgspec.Struct) -> None:
        buf = bytearray(b"event: %s\n" % event.__struct_config__.tag.encode() if self.named else b"")
        buf += _PREFIX
        _encoder.encode_into(event, buf, len(buf))
        buf += b"\n\n"
        await self.response.write(buf)

    async def close(self) -> None:
        if not self.named:
            await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
