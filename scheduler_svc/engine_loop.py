"""Drives the scheduler core against the executor's Run stream and fans outputs out to callers."""
import asyncio
import itertools

import grpc

from pagedserve.common import service
from pagedserve.common.log import get_logger
from pagedserve.common.plan import StepPlan, StepResult, plan_to_proto, result_from_proto
from pagedserve.common.pooling_params import PoolingParams
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.v1 import executor_pb2_grpc
from pagedserve.scheduler_svc.request import Request, RequestDelta
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.scheduler_svc.step_loop import StepLoop

log = get_logger(__name__)


class ExecutorLost(RuntimeError):
    """The executor's step stream broke; the caller may retry once the scheduler has reattached."""


class StreamTransport:
    """The executor's Run stream as the step loop's transport."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call

    async def launch(self, plan: StepPlan) -> None:
        try:
            await self.call.write(plan_to_proto(plan))
        except asyncio.InvalidStateError as e:
            # grpc's answer to a write on a stream that the executor has already ended.
            raise ExecutorLost("the executor closed the step stream") from e

    async def collect(self) -> StepResult:
        reply = await self.call.read()
        if reply is grpc.aio.EOF:
            raise ExecutorLost("the executor closed the step stream")
        return result_from_proto(reply)


class EngineLoop:
    """Owns the scheduler; every call runs on one asyncio loop, so no locks are needed."""

    def __init__(self, scheduler: Scheduler, executor: executor_pb2_grpc.ExecutorStub,
                 async_scheduling: bool = True) -> None:
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling
        self.steps = StepLoop(scheduler, async_scheduling)
        self.executor = executor
        self.outputs: dict[int, asyncio.Queue] = {}
        self.seq_ids: dict[str, int] = {}
        self.wakeup = asyncio.Event()
        self.seq_counter = itertools.count(1)
        self.error: ExecutorLost | None = None

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            queue: asyncio.Queue | None = None, cache_salt: str = "", pooling: PoolingParams | None = None,
            token_type_ids: list[int] | None = None, priority: int = 0,
            background: bool = False, lora_name: str = "") -> tuple[int, asyncio.Queue]:
        """Queues a request (a pooling one with `pooling`, batch work with `background`, run with the
        LoRA adapter `lora_name`) whose outputs go to `queue` (a new one by default, which several
        requests may share); raises ValueError for one the scheduler cannot take, QueueFull when the
        queue is full, and ExecutorLost while the executor is away."""
        if self.error:
            raise self.error
        if request_id in self.seq_ids:
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        seq_id = next(self.seq_counter)
        self.scheduler.add(Request(seq_id=seq_id, request_id=request_id, prompt_token_ids=prompt_token_ids,
                                   sampling=params, cache_salt=cache_salt, pooling=pooling,
                                   token_type_ids=token_type_ids or [], priority=priority,
                                   background=background, lora_name=lora_name))
        queue = asyncio.Queue() if queue is None else queue
        self.outputs[seq_id] = queue
        self.seq_ids[request_id] = seq_id
        self.wakeup.set()
        return seq_id, queue

    def abort(self, request_id: str) -> bool:
        seq_id = self.seq_ids.pop(request_id, None)
        if seq_id is None:
            return False
        self.outputs.pop(seq_id, None)
        self.scheduler.abort(seq_id)
        self.wakeup.set()
        return True

    async def run(self) -> None:
        """Steps until the executor's stream ends; then fails every caller waiting for output and
        returns. add() refuses requests from then until reset()."""
        call = self.executor.Run(metadata=service.call_metadata())
        stepping = asyncio.create_task(self.steps.run(StreamTransport(call), self._deliver,
                                                      self._wait_for_work))
        # The call's status arrives when the executor leaves, even while no step is in flight.
        ended = asyncio.create_task(call.code())
        try:
            await asyncio.wait((stepping, ended), return_when=asyncio.FIRST_COMPLETED)
            reason = _lost_reason(stepping, ended)
        finally:
            stepping.cancel()
            ended.cancel()
            call.cancel()
            await asyncio.gather(stepping, ended, return_exceptions=True)
        self._fail(reason)

    def reset(self, scheduler: Scheduler) -> None:
        """Serves again with a fresh scheduler: nothing of a lost executor's KV cache survives."""
        self.scheduler = scheduler
        self.steps = StepLoop(scheduler, self.async_scheduling)
        self.outputs.clear()
        self.seq_ids.clear()
        self.error = None

    def _fail(self, reason: str) -> None:
        self.error = ExecutorLost(f"the executor is unavailable ({reason}); retry shortly")
        log.error("executor_lost", reason=reason, failed_requests=len(self.outputs))
        for queue in set(self.outputs.values()):
            queue.put_nowait(self.error)

    async def _wait_for_work(self) -> None:
        # Nothing can run until a request arrives or leaves.
        self.wakeup.clear()
        await self.wakeup.wait()

    def _deliver(self, outputs: list[RequestDelta]) -> None:
        for out in outputs:
            queue = self.outputs.get(out.seq_id)
            if queue is None:
                continue
            queue.put_nowait(out)
            if out.finished:
                del self.outputs[out.seq_id]
                self.seq_ids.pop(out.request_id, None)


def _lost_reason(stepping: asyncio.Task, ended: asyncio.Task) -> str:
    """Why the executor's stream ended; re-raises a failure of the scheduler itself."""
    if not stepping.done():
        return f"the executor ended the step stream ({ended.result().name})"
    error = stepping.exception()
    if isinstance(error, grpc.aio.AioRpcError):
        return f"the executor stream failed: {error.code().name}: {error.details()}"
    if isinstance(error, ExecutorLost):
        return str(error)
    raise error or RuntimeError("the step loop returned while the executor stream was open")
