"""The executor's Run stream: plans launched as they arrive, results in plan order, errors fail it."""
from functools import partial

import grpc
import pytest

from pagedserve.executor_svc.server import ExecutorService
from pagedserve.common import service
from pagedserve.executor_svc.null_worker import TOKEN, NullWorker, null_executor_info
from pagedserve.common.plan import ContinuingRequest, NewRequest, StepPlan, plan_to_proto, result_from_proto
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.v1 import executor_pb2_grpc


@pytest.fixture
async def executor(tmp_path):
    address = f"unix://{tmp_path}/executor.sock"
    worker = NullWorker(null_executor_info(num_blocks=16, block_size=4, max_model_len=64))
    server = await service.start("executor", address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(worker)))
    async with service.channel(address) as channel:
        yield executor_pb2_grpc.ExecutorStub(channel)
    await server.stop()


async def test_two_plans_in_flight_come_back_in_order(executor):
    call = executor.Run()
    await call.write(plan_to_proto(StepPlan(1, new_requests=[NewRequest(7, [5, 6], 0, 2, [1],
                                                                        SamplingParams())])))
    # Planned before the first result: decodes the token the first step samples.
    await call.write(plan_to_proto(StepPlan(2, continuing=[ContinuingRequest(7, 1, [])])))
    first, second = result_from_proto(await call.read()), result_from_proto(await call.read())
    assert [(r.step_id, r.seq_ids, r.token_ids) for r in (first, second)] == [
        (1, [7], [TOKEN]), (2, [7], [TOKEN])]
    await call.done_writing()


async def test_a_plan_the_executor_cannot_run_fails_the_stream(executor):
    call = executor.Run()
    await call.write(plan_to_proto(StepPlan(1, continuing=[ContinuingRequest(99, 1, [])])))
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call.read()
    assert failed.value.code() == grpc.StatusCode.UNKNOWN
