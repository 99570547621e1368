"""One pooling request's engine work: a Pool call per input, all running at once, on the schedulers
the engine pool picks."""
import asyncio
import uuid
from dataclasses import dataclass, field

from pagedserve.gateway.engine_pool import EnginePool
from pagedserve.gateway.errors import APIError
from pagedserve.v1 import engine_pb2 as pb


@dataclass(slots=True)
class PoolInput:
    """One input as the model takes it; token_type_ids empty means all zeros."""
    token_ids: list[int]
    token_type_ids: list[int] = field(default_factory=list)


class Pooling:
    """Runs the Pool calls of one request concurrently; run() returns each input's data in order."""

    def __init__(self, engines: EnginePool, inputs: list[PoolInput], params: pb.PoolingParams,
                 trace_id: str, background: bool = False) -> None:
        self._engines = engines
        self.inputs = inputs
        self._params = params
        self._trace_id = trace_id
        # Batch work, which the scheduler runs on the capacity interactive requests leave.
        self._background = background
        # Client request ids may repeat (retries, proxies); engine request ids must not.
        self._request_id = uuid.uuid4().hex
        self._interrupted: asyncio.Future | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.inputs)

    def interrupt(self, error: Exception) -> None:
        """Makes run() raise `error` now (a shutdown)."""
        if self._interrupted is not None and not self._interrupted.done():
            self._interrupted.set_exception(error)

    async def run(self) -> list[list[float]]:
        """Each input's pooled data. The first call to fail raises its APIError; leaving early (a
        failure, an interruption, the handler cancelled) cancels the calls still running, which
        aborts them on their schedulers."""
        self._interrupted = asyncio.get_running_loop().create_future()
        calls = [asyncio.ensure_future(self._call(i, x)) for i, x in enumerate(self.inputs)]
        gathered = asyncio.gather(*calls)
        gathered.add_done_callback(_retrieve)
        try:
            await asyncio.wait((gathered, self._interrupted), return_when=asyncio.FIRST_COMPLETED)
            if self._interrupted.done():
                return self._interrupted.result()
            return gathered.result()
        finally:
            gathered.cancel()
            for call in calls:
                call.cancel()

    async def _call(self, index: int, item: PoolInput) -> list[float]:
        engine = self._engines.pick(item.token_ids, 1)
        request = pb.PoolRequest(request_id=f"{self._request_id}-{index}", prompt_token_ids=item.token_ids,
                                 token_type_ids=item.token_type_ids, params=self._params,
                                 background=self._background)
        try:
            return list((await engine.client.pool(request, self._trace_id)).data)
        except APIError as e:
            self._engines.failed(engine, e)
            raise
        finally:
            self._engines.ended(engine)


def _retrieve(gathered: asyncio.Future) -> None:
    # A gathering cancelled while its calls run ends with a CancelledError as its exception, which
    # asyncio would log as never retrieved.
    if not gathered.cancelled():
        gathered.exception()
