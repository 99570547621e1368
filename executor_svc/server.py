"""gRPC server around the worker: Describe, and a Run stream of step plans."""
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from pagedserve.executor_svc.device import device_broken
from pagedserve.executor_svc.model_runner import Launched
from pagedserve.executor_svc.worker import Worker
from pagedserve.common import service
from pagedserve.common.config import EngineConfig
from pagedserve.common.log import get_logger
from pagedserve.common.plan import StepPlan, StepResult, info_to_proto, plan_from_proto, result_to_proto
from pagedserve.v1 import executor_pb2, executor_pb2_grpc

log = get_logger(__name__)


class ExecutorService(executor_pb2_grpc.ExecutorServicer):
    """`health`, the server's health service, reports NOT_SERVING once the device fails."""

    def __init__(self, worker: Worker, health: health_aio.HealthServicer | None = None,
                 pool: ThreadPoolExecutor | None = None) -> None:
        self.worker = worker
        self.health = health
        # Why the device failed, once it has: no step can run again in this process.
        self.broken: str | None = None
        self.device_failed = asyncio.Event()
        # Launch and collect share one thread: they change the worker's host state, in order, off
        # the event loop so health checks answer. Waiting for the device takes another, so that a
        # plan that arrives meanwhile is launched behind the running step.
        self.pool = pool or forward_thread()
        self.waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-wait")
        self.busy = False

    async def Describe(self, request: executor_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> executor_pb2.ExecutorInfo:
        return info_to_proto(self.worker.describe())

    async def Run(self, request_iterator, context: grpc.aio.ServicerContext):
        if self.broken:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the executor's device failed ({self.broken}); "
                                                             "restart the executor")
        if self.busy:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "another scheduler is already attached to this executor")
        self.busy = True
        loop = asyncio.get_running_loop()
        log.info("scheduler_attached")
        launched: asyncio.Queue = asyncio.Queue()
        failed = threading.Event()
        reader = asyncio.create_task(self._launch_all(request_iterator, launched, failed))
        try:
            while (job := await launched.get()) is not None:
                if isinstance(job, Exception):
                    raise job
                step = await job
                if not isinstance(step, StepResult):
                    await loop.run_in_executor(self.waiter, self.worker.wait, step)
                    step = await loop.run_in_executor(self.pool, self.worker.collect, step)
                yield result_to_proto(step)
        except Exception as e:
            failed.set()
            if device_broken(e):
                await self._fail_device(e)
            raise
        finally:
            reader.cancel()
            _cancel_queued(launched)
            self.busy = False
            if not self.broken:
                await loop.run_in_executor(self.pool, self.worker.reset)
            log.info("scheduler_detached")

    async def _fail_device(self, error: Exception) -> None:
        """Reports NOT_SERVING for good: a failed device fails every later step, so the liveness
        probe, or `serve`, restarts the executor."""
        self.broken = str(error).splitlines()[0]
        log.error("device_failed", error=self.broken)
        if self.health is not None:
            await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.device_failed.set()

    async def _launch_all(self, request_iterator, launched: asyncio.Queue, failed: threading.Event) -> None:
        """Hands each plan to the forward thread as it arrives, queueing its launch for the result
        writer; then None. The thread takes the next plan as soon as it is done with the step
        before: waiting for each launch before reading the next plan put a trip through the event
        loop between CPU steps (the executor idle about 4.5% of a served one-stream step)."""
        loop = asyncio.get_running_loop()
        try:
            async for message in request_iterator:
                plan = plan_from_proto(message)
                launched.put_nowait(loop.run_in_executor(self.pool, self._launch, plan, failed))
        except Exception as e:  # noqa: BLE001 - handed to the writer, which fails the RPC with it
            launched.put_nowait(e)
        else:
            launched.put_nowait(None)

    def _launch(self, plan: StepPlan, failed: threading.Event) -> Launched | StepResult | None:
        """The plan's step launched, or, where launching ran it (a CPU), its result: collected by
        a later job, behind a hop to the waiter thread, it often waited for the next plan's whole
        step, which the scheduler had sent meanwhile (SmolLM2 served one stream on the 2-core
        machine: time to first token 93-107 ms that way, 82-86 ms collected at once). None, not
        run, once a launch of the stream has failed: the forward thread takes the next plan
        before the event loop hears of the failure."""
        if failed.is_set():
            return None
        try:
            step = self.worker.launch(plan)
            return self.worker.collect(step) if self.worker.synchronous else step
        except BaseException:
            failed.set()
            raise


def _cancel_queued(launched: asyncio.Queue) -> None:
    # Launches queued behind a step that failed the stream: none leaves a result or an exception
    # that no one retrieves.
    while not launched.empty():
        job = launched.get_nowait()
        if isinstance(job, asyncio.Future):
            job.cancel()


def forward_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")


async def serve(config: EngineConfig, address: str) -> None:
    """Loads the model, then serves the Executor service at `address` until SIGINT/SIGTERM, or
    until the device fails, which exits with an error (restart policies then start it again)."""
    # The worker is built on the thread that runs its steps: libgomp gives each thread that starts
    # a parallel region a team of its own, and with more of its threads than cores (two teams of
    # two on two cores) it stops spinning at barriers; a two-thread CPU step in the server took
    # 62 ms that way against 37 ms with one team (SmolLM2, the 2-core machine).
    pool = forward_thread()
    worker = await asyncio.get_running_loop().run_in_executor(pool, Worker, config)
    info = worker.describe()
    log.info("executor_ready", address=address, device=info.device, dtype=info.dtype,
             num_blocks=info.num_blocks, block_size=info.block_size)
    health = health_aio.HealthServicer()
    executor = ExecutorService(worker, health, pool)
    running = await service.start("executor", address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, executor), health)
    stopping = [asyncio.create_task(service.wait_for_signal()), asyncio.create_task(executor.device_failed.wait())]
    await asyncio.wait(stopping, return_when=asyncio.FIRST_COMPLETED)
    for task in stopping:
        task.cancel()
    await running.stop()
    if executor.broken:
        raise SystemExit(f"executor: the device failed ({executor.broken}); restart the executor")
