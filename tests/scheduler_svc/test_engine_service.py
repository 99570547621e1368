import asyncio
from functools import partial

import pytest

from pagedserve.executor_svc.server import ExecutorService
from pagedserve.common import service
from pagedserve.executor_svc.null_worker import NullWorker, null_executor_info
from pagedserve.common.config import EngineConfig
from pagedserve.v1 import engine_pb2, engine_pb2_grpc, executor_pb2_grpc, sampling_pb2
from pagedserve.scheduler_svc.engine_loop import EngineLoop
from pagedserve.scheduler_svc.request import RequestDelta, TokenLogprobs
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.scheduler_svc.server import (BUCKETS_S, EngineService, check_geometry, response_from_outputs,
                                             serve)


def output(tokens: list[int], finished: bool = False, reason: str | None = None,
           logprobs: list[TokenLogprobs] | None = None) -> RequestDelta:
    return RequestDelta(seq_id=1, request_id="r", new_token_ids=tokens, finished=finished,
                         finish_reason=reason, stop_token_id=2 if reason == "stop" else None,
                         num_prompt_tokens=5, num_output_tokens=0, num_cached_tokens=4,
                         logprobs=logprobs)


def test_consecutive_outputs_travel_as_one_response():
    outs = [output([7]), output([8]), output([2], finished=True, reason="stop")]
    outs[-1].num_output_tokens = 3
    response = response_from_outputs(outs)
    assert list(response.token_ids) == [7, 8, 2]
    assert response.finish_reason == engine_pb2.FINISH_REASON_STOP
    assert response.stop_token_id == 2 and response.completion_tokens == 3
    assert (response.prompt_tokens, response.cached_tokens) == (5, 4)


@pytest.mark.parametrize("count", [1, 3])
def test_merged_logprobs_stay_one_per_token(count):
    outs = [output([10 + i], logprobs=[TokenLogprobs(-0.5 * i, i + 1, [10 + i], [-0.5 * i])])
            for i in range(count)]
    response = response_from_outputs(outs)
    assert [lp.rank for lp in response.logprobs] == list(range(1, count + 1))
    assert [list(lp.top_token_ids) for lp in response.logprobs] == [[10 + i] for i in range(count)]
    assert not response.HasField("stop_token_id")
    assert response.finish_reason == engine_pb2.FINISH_REASON_UNSPECIFIED


async def test_model_info_carries_the_step_histograms(tmp_path):
    """The real scheduler steps a null executor over gRPC; GetModelInfo then reports its stats."""
    info = null_executor_info(num_blocks=64, block_size=16, max_model_len=128)
    executor_address, engine_address = f"unix://{tmp_path}/executor.sock", f"unix://{tmp_path}/engine.sock"
    executor = await service.start("executor", executor_address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(NullWorker(info))))
    config = EngineConfig()
    scheduler = Scheduler(config, info)
    async with service.channel(executor_address) as channel, service.channel(engine_address) as engine:
        loop = EngineLoop(scheduler, executor_pb2_grpc.ExecutorStub(channel))
        stepping = asyncio.create_task(loop.run())
        server = await service.start("scheduler", engine_address, partial(
            engine_pb2_grpc.add_EngineServicer_to_server, EngineService(loop, config, info)))
        stub = engine_pb2_grpc.EngineStub(engine)
        request = engine_pb2.GenerateRequest(request_id="r", prompt_token_ids=[5] * 20,
                                             params=sampling_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
        tokens = [t async for response in stub.Generate(request) for t in response.token_ids]
        while scheduler.has_work() or loop.steps.in_flight:  # the step that drops the finished request
            await asyncio.sleep(0.01)
        reply = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
        stepping.cancel()
        await server.stop()
    await executor.stop()
    assert len(tokens) == 4
    # vLLM's cache_config_info label: the flag as given.
    assert reply.cache_dtype == config.kv_cache_dtype == "auto"
    stats = scheduler.stats
    # A prefill, three decodes and the step that drops the request; all but the first back to back.
    assert (stats.scheduler.count, stats.idle.count) == (5, 4)
    for h, ours in ((reply.step_schedule, stats.scheduler), (reply.step_forward, stats.forward),
                    (reply.step_idle, stats.idle)):
        assert list(h.bucket_upper_bounds_s) == BUCKETS_S and list(h.bucket_counts) == ours.counts
        assert h.count == ours.count == sum(h.bucket_counts)
        assert h.sum_s == pytest.approx(ours.sum_ns / 1e9) and h.sum_s > 0


async def test_model_info_counts_background_requests_apart(tmp_path):
    """A background request on GenerateStream and an interactive one on Generate, both running."""
    # Long enough that neither finishes before the counts are read, on a loaded machine too.
    info = null_executor_info(num_blocks=8192, block_size=16, max_model_len=65536)
    executor_address, engine_address = f"unix://{tmp_path}/executor.sock", f"unix://{tmp_path}/engine.sock"
    executor = await service.start("executor", executor_address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(NullWorker(info))))
    config = EngineConfig()
    async with service.channel(executor_address) as channel, service.channel(engine_address) as engine:
        loop = EngineLoop(Scheduler(config, info), executor_pb2_grpc.ExecutorStub(channel))
        stepping = asyncio.create_task(loop.run())
        server = await service.start("scheduler", engine_address, partial(
            engine_pb2_grpc.add_EngineServicer_to_server, EngineService(loop, config, info)))
        stub = engine_pb2_grpc.EngineStub(engine)
        params = sampling_pb2.SamplingParams(max_tokens=60000, ignore_eos=True)
        batch = stub.GenerateStream(iter([engine_pb2.StreamRequest(generate=engine_pb2.GenerateRequest(
            request_id="b", prompt_token_ids=[5] * 20, params=params, background=True))]))
        chat = stub.Generate(engine_pb2.GenerateRequest(request_id="i", prompt_token_ids=[6] * 20, params=params))
        await batch.read()
        await chat.read()
        reply = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
        batch.cancel()
        chat.cancel()
        stepping.cancel()
        await server.stop()
    await executor.stop()
    assert (reply.num_running, reply.num_background_running, reply.num_background_waiting) == (2, 1, 0)


@pytest.mark.parametrize("flag, value", [("block_size", 32), ("max_model_len", 64),
                                         ("num_gpu_blocks_override", 10), ("dtype", "float16")])
async def test_scheduler_refuses_geometry_that_disagrees_with_the_executor(tmp_path, flag, value):
    info = null_executor_info(num_blocks=64, block_size=16, max_model_len=128)
    executor_address = f"unix://{tmp_path}/executor.sock"
    executor = await service.start("executor", executor_address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(NullWorker(info))))
    try:
        with pytest.raises(SystemExit) as refused:
            await serve(EngineConfig(), f"unix://{tmp_path}/engine.sock", executor_address, {flag: value})
    finally:
        await executor.stop()
    message = str(refused.value)
    dashed = "--" + flag.replace("_", "-")
    assert "\n" not in message and message.startswith(f"scheduler: {dashed} {value} disagrees")
    assert f"start the executor with {dashed} {value}" in message


def test_matching_or_auto_geometry_is_accepted():
    info = null_executor_info(num_blocks=64, block_size=16, max_model_len=128)
    check_geometry({"block_size": 16, "max_model_len": 128, "num_gpu_blocks_override": 64, "dtype": "auto"},
                   info, "unix:///x")
