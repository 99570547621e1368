"""What the scheduler checks of every request, since a direct Engine API caller passes no gateway:
token ids against the vocabulary and list lengths against their bounds (INVALID_ARGUMENT, and the
engine serves on), and the token every call must carry; and a request the executor fails on its
own ends alone."""
import asyncio
import time
from functools import partial

import grpc
import pytest

from pagedserve.common import service
from pagedserve.common.config import EngineConfig
from pagedserve.common.plan import NewRequest, StepPlan, plan_from_proto, plan_to_proto
from pagedserve.common.sampling_params import (MAX_BAD_WORDS_TOKENS, MAX_CONSTRAINT_CHARS, MAX_LOGIT_BIAS_TOKENS,
                                               MAX_LOGPROBS, MAX_REASONING_END_IDS, MAX_STOP_TOKEN_IDS, OutOfRange,
                                               SamplingParams, StructuredOutputsParams, check_request,
                                               sampling_from_proto, sampling_to_proto)
from pagedserve.executor_svc.null_worker import VOCAB, NullWorker, null_executor_info
from pagedserve.executor_svc.server import ExecutorService
from pagedserve.scheduler_svc.server import serve
from pagedserve.v1 import engine_pb2, engine_pb2_grpc, executor_pb2_grpc, sampling_pb2
from tests.executor_svc.harness import make_worker
from tests.gateway.fake_engine import build_tiny_tokenizer
from tests.scheduler_svc.helpers import add, make_scheduler
from tests.tiny_models import make_tiny_model

SECRET = "engine-token"
V = VOCAB


@pytest.mark.parametrize("prompt, params, field", [
    ([-1], {}, "prompt_token_ids"),
    ([V], {}, "prompt_token_ids"),
    ([1], {"stop_token_ids": [V]}, "stop_token_ids"),
    ([1], {"logit_bias": {V + 1: 100}}, "logit_bias"),
    ([1], {"allowed_token_ids": [3, V]}, "allowed_token_ids"),
    ([1], {"bad_words_token_ids": [[2], [1, V]]}, "bad_words"),
    ([1], {"structured_outputs": StructuredOutputsParams(regex="a+", reasoning_end_ids=[V])}, "reasoning_end_ids"),
])
def test_an_id_outside_the_vocabulary_names_its_field(prompt, params, field):
    with pytest.raises(OutOfRange, match=f"{field} must be in \\[0, {V - 1}\\]") as refused:
        check_request(prompt, SamplingParams(**params), V, MAX_LOGPROBS)
    assert refused.value.param == field


@pytest.mark.parametrize("params, field", [
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"logit_bias": {t: 1.0 for t in range(MAX_LOGIT_BIAS_TOKENS + 1)}}, "logit_bias"),
    ({"bad_words_token_ids": [[1, 2]] * (MAX_BAD_WORDS_TOKENS // 2 + 1)}, "bad_words"),
    ({"structured_outputs": StructuredOutputsParams(regex="a", reasoning_end_ids=[1] * (MAX_REASONING_END_IDS + 1))},
     "reasoning_end_ids"),
    ({"structured_outputs": StructuredOutputsParams(choice=["x" * 1000] * (MAX_CONSTRAINT_CHARS // 1000 + 1))},
     "structured_outputs"),
])
def test_a_list_past_its_bound_is_refused(params, field):
    with pytest.raises(ValueError, match=f"^{field} holds"):
        check_request([1], SamplingParams(**params), V, MAX_LOGPROBS)


def test_an_empty_allowed_token_ids_allows_nothing_and_is_refused():
    with pytest.raises(ValueError, match="^allowed_token_ids is empty"):
        check_request([1], SamplingParams(allowed_token_ids=[]), V, MAX_LOGPROBS)


def test_the_scheduler_core_refuses_them_before_queueing():
    s = make_scheduler()
    with pytest.raises(OutOfRange, match="prompt_token_ids"):
        add(s, 1, 4, first_token=s.vocab_size - 2)
    with pytest.raises(OutOfRange, match="logit_bias"):
        add(s, 2, 4, logit_bias={s.vocab_size: 1.0})
    assert not s.has_work()
    add(s, 3, 4, first_token=s.vocab_size - 4, logit_bias={s.vocab_size - 1: 1.0})
    assert s.num_waiting == 1


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_past_the_executors_max_logprobs_are_refused_naming_the_flag(field):
    s = make_scheduler(max_logprobs=5)
    with pytest.raises(OutOfRange, match=f"{field} must be in \\[0, 5\\] \\(the server's --max-logprobs\\), got 6"):
        add(s, 1, 4, **{field: 6})
    add(s, 2, 4, **{field: 5})
    assert s.num_waiting == 1


def test_a_request_at_the_bias_bound_costs_the_scheduler_well_under_5_ms():
    """The scheduler's share of a request with MAX_LOGIT_BIAS_TOKENS biased tokens: decoding its
    params, checking them, and encoding them into the plan, plus the executor's decode. About 1 ms
    here (a loaded 2-core machine); the bound leaves a 5x margin."""
    message = sampling_to_proto(SamplingParams(logit_bias={t: 1.5 for t in range(MAX_LOGIT_BIAS_TOKENS)}))
    plan = StepPlan(1, new_requests=[NewRequest(1, [1] * 64, 0, 64, [1, 2, 3, 4], SamplingParams())])

    def one_request() -> None:
        params = sampling_from_proto(message)
        check_request([1] * 64, params, V, MAX_LOGPROBS)
        plan.new_requests[0].sampling = params
        plan_from_proto(plan_to_proto(plan))

    one_request()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        one_request()
        times.append(time.perf_counter() - start)
    assert sorted(times)[len(times) // 2] < 0.005


@pytest.fixture
async def engine(tmp_path, monkeypatch):
    """The real scheduler server on a null executor, both requiring the token: an Engine stub."""
    monkeypatch.setenv(service.TOKEN_ENV, SECRET)
    executor_address, address = f"unix://{tmp_path}/executor.sock", f"unix://{tmp_path}/engine.sock"
    info = null_executor_info(num_blocks=64, block_size=16, max_model_len=256)
    executor = await service.start("executor", executor_address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(NullWorker(info))))
    serving = asyncio.create_task(serve(EngineConfig(), address, executor_address))
    await service.wait_serving(address, timeout=10)
    async with service.channel(address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)
    await executor.server.stop(0)


async def generate(stub: engine_pb2_grpc.EngineStub, rid: str, prompt: list[int], metadata=None,
                   **params) -> list[int]:
    request = engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=sampling_pb2.SamplingParams(
        max_tokens=3, ignore_eos=True, **params))
    return [t async for r in stub.Generate(request, metadata=metadata, timeout=20) for t in r.token_ids]


async def test_over_grpc_a_bad_id_is_invalid_argument_and_the_next_request_completes(engine):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(engine, "anonymous", [1, 2])
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    token = service.call_metadata()
    bad = [("neg", [-1], {}), ("vocab", [V], {}), ("bias", [1], {"logit_bias": {V + 1: 100}}),
           ("stop", [1], {"stop_token_ids": [V]}),
           ("think", [1], {"structured_outputs": sampling_pb2.StructuredOutputs(regex="a", reasoning_end_ids=[V])})]
    for rid, prompt, params in bad:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(engine, rid, prompt, token, **params)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rid
        assert f"[0, {V - 1}]" in refused.value.details()
        assert len(await generate(engine, f"ok-{rid}", [1, 2, 3], token)) == 3


async def test_a_request_the_executor_fails_ends_alone_on_both_rpcs(tmp_path):
    """A constraint that cannot compile (which the gateway would have refused) fails its own request;
    the executor's step goes on for the others."""
    model = make_tiny_model("LlamaForCausalLM", tmp_path / "model")
    build_tiny_tokenizer(model)
    executor_address, address = f"unix://{tmp_path}/executor.sock", f"unix://{tmp_path}/engine.sock"
    executor = await service.start("executor", executor_address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(make_worker(model))))
    serving = asyncio.create_task(serve(EngineConfig(), address, executor_address))
    await service.wait_serving(address, timeout=10)
    broken = sampling_pb2.StructuredOutputs(regex="(unclosed")
    try:
        async with service.channel(address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await generate(stub, "alone", [5, 6, 7], structured_outputs=broken)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cannot be compiled" in failed.value.details()
            requests = [engine_pb2.StreamRequest(generate=engine_pb2.GenerateRequest(
                request_id=rid, prompt_token_ids=[5, 6, 7], params=sampling_pb2.SamplingParams(
                    max_tokens=4, ignore_eos=True, structured_outputs=constraint)))
                for rid, constraint in (("good", None), ("bad", broken))]
            outcomes = {}
            async for message in stub.GenerateStream(iter(requests)):
                for out in message.outputs:
                    got = outcomes.setdefault(out.request_id, [])
                    got += [out.error_code] if out.error_code else list(out.response.token_ids)
            assert outcomes["bad"] == [grpc.StatusCode.INVALID_ARGUMENT.value[0]]
            assert len(outcomes["good"]) == 4
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await executor.server.stop(0)
