"""gRPC server around the worker: Describe, and a Run stream of step plans."""
import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc

from pagedserve.executor_svc.worker import Worker
from pagedserve.common import service
from pagedserve.common.config import EngineConfig
from pagedserve.common.log import get_logger
from pagedserve.common.plan import info_to_proto, plan_from_proto, result_to_proto
from pagedserve.v1 import executor_pb2, executor_pb2_grpc

log = get_logger(__name__)


class ExecutorService(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        # Launch and collect share one thread: they change the worker's host state, in order, off
        # the event loop so health checks answer. Waiting for the device takes another, so that a
        # plan that arrives meanwhile is launched behind the running step.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-wait")
        self.busy = False

    async def Describe(self, request: executor_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> executor_pb2.ExecutorInfo:
        return info_to_proto(self.worker.describe())

    async def Run(self, request_iterator, context: grpc.aio.ServicerContext):
        if self.busy:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "another scheduler is already attached to this executor")
        self.busy = True
        loop = asyncio.get_running_loop()
        log.info("scheduler_attached")
        launched: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(self._launch_all(request_iterator, launched))
        try:
            while (step := await launched.get()) is not None:
                if isinstance(step, Exception):
                    raise step
                await loop.run_in_executor(self.waiter, self.worker.wait, step)
                result = await loop.run_in_executor(self.pool, self.worker.collect, step)
                yield result_to_proto(result)
        finally:
            reader.cancel()
            self.busy = False
            await loop.run_in_executor(self.pool, self.worker.reset)
            log.info("scheduler_detached")

    async def _launch_all(self, request_iterator, launched: asyncio.Queue) -> None:
        """Launches each plan as it arrives, queueing the step for the result writer; then None."""
        loop = asyncio.get_running_loop()
        try:
            async for message in request_iterator:
                plan = plan_from_proto(message)
                launched.put_nowait(await loop.run_in_executor(self.pool, self.worker.launch, plan))
        except Exception as e:  # noqa: BLE001 - handed to the writer, which fails the RPC with it
            launched.put_nowait(e)
        else:
            launched.put_nowait(None)


async def serve(config: EngineConfig, address: str) -> None:
    """Loads the model, then serves the Executor service at `address` until SIGINT/SIGTERM."""
    worker = Worker(config)
    info = worker.describe()
    log.info("executor_ready", address=address, device=info.device, dtype=info.dtype,
             num_blocks=info.num_blocks, block_size=info.block_size)
    running = await service.start("executor", address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(worker)))
    await service.wait_for_signal()
    await running.stop()
