"""gRPC server around the model runner: Describe, and a Run stream of step plans."""
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc

from executor_svc.model_runner import ModelRunner
from pagedserve import service
from pagedserve.config import EngineConfig
from pagedserve.log import get_logger
from pagedserve.plan import info_to_proto, plan_from_proto, result_to_proto
from pagedserve.v1 import executor_pb2, executor_pb2_grpc

log = get_logger(__name__)


class ExecutorService(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # One thread: the model must run steps in order, off the event loop so health checks answer.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.busy = False

    async def Describe(self, request: executor_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> executor_pb2.ExecutorInfo:
        return info_to_proto(self.runner.describe())

    async def Run(self, request_iterator, context: grpc.aio.ServicerContext):
        if self.busy:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "another scheduler is already attached to this executor")
        self.busy = True
        loop = asyncio.get_running_loop()
        log.info("scheduler_attached")
        # Between one step's end and the next one's start the model has nothing to do: that gap
        # is what the control path (result and plan encoding, RPC, scheduling) costs the GPU.
        done = 0
        try:
            async for message in request_iterator:
                plan = plan_from_proto(message)
                start = time.perf_counter_ns()
                result = await loop.run_in_executor(self.pool, self.runner.run, plan)
                if done:
                    result.idle_ns = start - done
                done = time.perf_counter_ns()
                yield result_to_proto(result)
        finally:
            self.busy = False
            await loop.run_in_executor(self.pool, self.runner.reset)
            log.info("scheduler_detached")


async def serve(config: EngineConfig, address: str) -> None:
    """Loads the model, then serves the Executor service at `address` until SIGINT/SIGTERM."""
    runner = ModelRunner(config)
    info = runner.describe()
    log.info("executor_ready", address=address, device=info.device, dtype=info.dtype,
             num_blocks=info.num_blocks, block_size=info.block_size)
    running = await service.start("executor", address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(runner)))
    await service.wait_for_signal()
    await running.stop()
