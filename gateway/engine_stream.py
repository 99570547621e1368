"""The one GenerateStream call a gateway keeps to each scheduler: every request it sends that
scheduler goes out on it, and each message back carries an engine step's outputs for all of them."""
import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from pagedserve.v1 import engine_pb2 as pb
from pagedserve.v1.engine_pb2_grpc import EngineStub

_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(slots=True, frozen=True)
class Failed:
    """The status a request ended with when the scheduler refused or failed it, or the call broke."""
    code: grpc.StatusCode
    details: str


# What a request's queue receives: its responses, and a Failed last if it did not finish.
Reply = pb.GenerateResponse | Failed


class EngineStream:
    """An open GenerateStream call. Once it breaks (`error` is set) every request on it has received
    the error, and the caller opens another for new requests."""

    def __init__(self, stub: EngineStub) -> None:
        self._writes: asyncio.Queue[pb.StreamRequest] = asyncio.Queue()
        self._queues: dict[str, asyncio.Queue[Reply]] = {}
        self.error: Failed | None = None
        self._call = stub.GenerateStream(self._requests())
        self._reading = asyncio.create_task(self._read())

    def open(self, request: pb.GenerateRequest, trace_id: str) -> asyncio.Queue[Reply]:
        """Sends `request`; its replies arrive on the queue returned."""
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._writes.put_nowait(pb.StreamRequest(generate=request, trace_id=trace_id))
        return queue

    def close(self, request_id: str) -> None:
        """Ends a request's part in the call; one the scheduler has not ended is aborted there."""
        if self._queues.pop(request_id, None) is not None and self.error is None:
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
            for queue in self._queues.values():
                queue.put_nowait(error)
            self._queues.clear()

    def _deliver(self, output: pb.StreamOutput) -> None:
        queue = self._queues.get(output.request_id)
        if queue is None:
            return
        if output.error_code:
            del self._queues[output.request_id]
            queue.put_nowait(Failed(_CODES[output.error_code], output.error_message))
            return
        if output.response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            del self._queues[output.request_id]
        queue.put_nowait(output.response)
