"""The scheduler survives its executor: in-flight requests fail with UNAVAILABLE, health turns
NOT_SERVING, and once an executor serves the same model at the address again, requests succeed.
Also: a full queue is RESOURCE_EXHAUSTED. All in-process, on a null executor."""
import asyncio
import time
from functools import partial

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.common import service
from pagedserve.common.config import EngineConfig
from pagedserve.executor_svc.null_worker import NullWorker, null_executor_info
from pagedserve.executor_svc.server import ExecutorService
from pagedserve.scheduler_svc.server import serve
from pagedserve.v1 import engine_pb2, engine_pb2_grpc, executor_pb2_grpc, sampling_pb2

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def start_executor(address: str, max_model_len: int = 4096) -> service.Service:
    info = null_executor_info(num_blocks=1024, block_size=16, max_model_len=max_model_len, max_num_seqs=2)
    return await service.start("executor", address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(NullWorker(info))))


def request(rid: str, max_tokens: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=[5] * 8, params=sampling_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))


async def wait_status(health: health_pb2_grpc.HealthStub, status: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (await health.Check(health_pb2.HealthCheckRequest())).status != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        await asyncio.sleep(0.02)


@pytest.fixture
async def scheduler(tmp_path):
    """A scheduler on a null executor: (engine stub, health stub, executor address, serve task)."""
    executor_address, address = f"unix://{tmp_path}/executor.sock", f"unix://{tmp_path}/engine.sock"
    executors = [await start_executor(executor_address)]
    config = EngineConfig(max_num_queued_reqs=1)
    serving = asyncio.create_task(serve(config, address, executor_address))
    await service.wait_serving(address, timeout=10)
    async with service.channel(address) as channel:
        yield (engine_pb2_grpc.EngineStub(channel), health_pb2_grpc.HealthStub(channel), executor_address,
               serving, executors)
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)
    for executor in executors:
        await executor.server.stop(0)


async def test_executor_restart_fails_in_flight_then_serves_again(scheduler):
    engine, health, executor_address, _, executors = scheduler
    call = engine.Generate(request("long", 4000))
    await call.read()
    await executors[0].server.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        while await call.read() is not grpc.aio.EOF:
            pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    await wait_status(health, NOT_SERVING)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await engine.Generate(request("meanwhile", 2)).read()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    executors.append(await start_executor(executor_address))
    await wait_status(health, SERVING)
    tokens = [t async for reply in engine.Generate(request("after", 5)) for t in reply.token_ids]
    assert len(tokens) == 5
    info = await engine.GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert (info.num_running, info.num_waiting, info.num_free_blocks) == (0, 0, info.num_blocks)


async def test_an_idle_scheduler_notices_a_lost_executor(scheduler):
    _, health, _, _, executors = scheduler
    await executors[0].server.stop(0)
    await wait_status(health, NOT_SERVING)


async def test_an_executor_back_with_another_model_stops_the_scheduler(tmp_path):
    executor_address, address = f"unix://{tmp_path}/executor.sock", f"unix://{tmp_path}/engine.sock"
    first = await start_executor(executor_address)

    async def swap_executor() -> service.Service:
        await service.wait_serving(address, timeout=10)
        await first.server.stop(0)
        return await start_executor(executor_address, max_model_len=2048)

    swapping = asyncio.create_task(swap_executor())
    # Awaited here, not in a task: the SystemExit it raises must reach this coroutine.
    with pytest.raises(SystemExit, match="came back with max_model_len 2048, not 4096"):
        await serve(EngineConfig(), address, executor_address)
    await (await swapping).server.stop(0)


async def test_a_full_queue_is_resource_exhausted(scheduler):
    engine, *_ = scheduler
    calls = [engine.Generate(request(f"r{i}", 4000)) for i in range(3)]
    # Two run, one waits for a slot: the queue is full.
    while (info := await engine.GetModelInfo(engine_pb2.GetModelInfoRequest())).num_running < 2:
        await asyncio.sleep(0.01)
    assert info.num_waiting == 1
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await engine.Generate(request("one too many", 2)).read()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-num-queued-reqs" in refused.value.details()
    for call in calls:
        call.cancel()
