"""The one GenerateStream call a gateway keeps to each scheduler: every request it sends that
scheduler goes out on it, and each message back carries an engine step's outputs for all of them."""
import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from pagedserve.common import service
from pagedserve.v1 import engine_pb2 as pb
from pagedserve.v1.engine_pb2_grpc import EngineStub

_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(slots=True, frozen=True)
class Failed:
    """The status a request ended with when the scheduler refused or failed it, or the call broke."""
    code: grpc.StatusCode
    details: str


class EngineStream:
    """An open GenerateStream call. Once it breaks (`error` is set) every request on it has received
    the error, and the caller opens another for new requests."""

    def __init__(self, stub: EngineStub) -> None:
        self._writes: asyncio.Queue[pb.StreamRequest] = asyncio.Queue()
        # Request id -> (the callback for its responses, the one for its failure).
        self._deliver_to: dict[str, tuple[Callable[[pb.GenerateResponse], None], Callable[[Failed], None]]] = {}
        self.error: Failed | None = None
        self._call = stub.GenerateStream(self._requests(), metadata=service.call_metadata())
        self._reading = asyncio.create_task(self._read())

    def open(self, request: pb.GenerateRequest, trace_id: str, deliver: Callable[[pb.GenerateResponse], None],
             fail: Callable[[Failed], None]) -> None:
        """Sends `request`; `deliver` is called with each of its responses as they arrive, and `fail`
        instead, once, if the scheduler refuses or fails it."""
        self._deliver_to[request.request_id] = (deliver, fail)
        self._writes.put_nowait(pb.StreamRequest(generate=request, trace_id=trace_id))

    def close(self, request_id: str) -> None:
        """Ends a request's part in the call; one the scheduler has not ended is aborted there."""
        if self._deliver_to.pop(request_id, None) is not None and self.error is None:
            self._writes.put_nowait(pb.StreamRequest(abort=pb.AbortRequest(request_id=request_id)))

    async def aclose(self) -> None:
        self._call.cancel()
        self._reading.cancel()
        await asyncio.gather(self._reading, return_exceptions=True)

    async def _requests(self) -> AsyncIterator[pb.StreamRequest]:
        while True:
            yield await self._writes.get()

    async def _read(self) -> None:
        error = Failed(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the stream")
        try:
            async for message in self._call:
                for output in message.outputs:
                    self._deliver(output)
        except grpc.aio.AioRpcError as e:
            error = Failed(e.code(), e.details())
        finally:
            # However the call ends, no request is left waiting on it.
            self.error = error
            for _, fail in self._deliver_to.values():
                fail(error)
            self._deliver_to.clear()

    def _deliver(self, output: pb.StreamOutput) -> None:
        callbacks = self._deliver_to.get(output.request_id)
        if callbacks is None:
            return
        deliver, fail = callbacks
        if output.error_code:
            del self._deliver_to[output.request_id]
            fail(Failed(_CODES[output.error_code], output.error_message))
            return
        if output.response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            del self._deliver_to[output.request_id]
        deliver(output.response)
