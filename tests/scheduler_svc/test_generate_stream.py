"""GenerateStream on the real scheduler over a null executor: many requests on one call, each
message carrying a step's outputs for several of them; refusals, aborts and a cancelled call end
only what they should; a lost executor fails the call."""
import asyncio
from collections import defaultdict
from functools import partial

import grpc
import pytest

from pagedserve.common import service
from pagedserve.common.config import EngineConfig
from pagedserve.executor_svc.null_worker import NullWorker, null_executor_info
from pagedserve.executor_svc.server import ExecutorService
from pagedserve.scheduler_svc.generate_stream import SHUTTING_DOWN, StreamCall
from pagedserve.scheduler_svc.server import serve
from pagedserve.v1 import engine_pb2, engine_pb2_grpc, executor_pb2_grpc, sampling_pb2

MAX_MODEL_LEN = 512


def generate(rid: str, max_tokens: int, prompt_len: int = 8) -> engine_pb2.StreamRequest:
    return engine_pb2.StreamRequest(generate=engine_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=[5] * prompt_len,
        params=sampling_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)), trace_id=f"trace-{rid}")


def abort(rid: str) -> engine_pb2.StreamRequest:
    return engine_pb2.StreamRequest(abort=engine_pb2.AbortRequest(request_id=rid))


class Caller:
    """One GenerateStream call whose requests are written as the test goes; None half-closes it."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self.writes: asyncio.Queue = asyncio.Queue()
        self.call = stub.GenerateStream(self._messages())

    def send(self, *messages: engine_pb2.StreamRequest | None) -> None:
        for message in messages:
            self.writes.put_nowait(message)

    async def _messages(self):
        while (message := await self.writes.get()) is not None:
            yield message


@pytest.fixture
async def engine(tmp_path):
    """A scheduler on a null executor: (engine stub, executor service)."""
    executor_address, address = f"unix://{tmp_path}/executor.sock", f"unix://{tmp_path}/engine.sock"
    info = null_executor_info(num_blocks=256, block_size=16, max_model_len=MAX_MODEL_LEN)
    executor = await service.start("executor", executor_address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(NullWorker(info))))
    serving = asyncio.create_task(serve(EngineConfig(), address, executor_address))
    await service.wait_serving(address, timeout=10)
    async with service.channel(address) as channel:
        yield engine_pb2_grpc.EngineStub(channel), executor
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)
    await executor.server.stop(0)


async def wait_idle(stub: engine_pb2_grpc.EngineStub) -> engine_pb2.ModelInfo:
    for _ in range(500):
        info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
        if info.num_running == info.num_waiting == 0 and info.num_free_blocks == info.num_blocks:
            return info
        await asyncio.sleep(0.01)
    raise AssertionError(f"requests still hold the scheduler: {info}")


async def test_one_call_carries_many_requests_with_a_step_of_all_in_one_message(engine):
    stub, _ = engine
    caller = Caller(stub)
    caller.send(*(generate(f"r{i}", 20) for i in range(6)), None)
    tokens, finished, widest, messages = defaultdict(list), {}, 0, 0
    async for message in caller.call:
        messages += 1
        widest = max(widest, len(message.outputs))
        for out in message.outputs:
            tokens[out.request_id] += out.response.token_ids
            if out.response.finish_reason:
                finished[out.request_id] = out.response
    # The call ended by itself: the caller had closed its side and every request finished.
    assert await caller.call.code() == grpc.StatusCode.OK
    assert {rid: len(t) for rid, t in tokens.items()} == {f"r{i}": 20 for i in range(6)}
    assert all(r.finish_reason == engine_pb2.FINISH_REASON_LENGTH and r.completion_tokens == 20
               for r in finished.values())
    assert widest == 6 and messages < 6 * 20


async def test_a_refusal_ends_only_its_request(engine):
    stub, _ = engine
    caller = Caller(stub)
    caller.send(generate("ok", 10), generate("ok", 3), generate("too-long", 4, prompt_len=MAX_MODEL_LEN + 1), None)
    refusals, tokens = [], []
    async for message in caller.call:
        for out in message.outputs:
            if out.error_code:
                refusals.append((out.request_id, grpc.StatusCode.INVALID_ARGUMENT.value[0] == out.error_code,
                                 out.error_message))
            else:
                tokens += out.response.token_ids
    assert [(rid, invalid) for rid, invalid, _ in refusals] == [("ok", True), ("too-long", True)]
    assert "already running" in refusals[0][2] and "\n" not in refusals[1][2]
    # The running request the duplicate named finished untouched.
    assert len(tokens) == 10


async def test_abort_and_a_cancelled_call_free_their_requests(engine):
    stub, _ = engine
    caller = Caller(stub)
    caller.send(generate("a", 400), generate("b", 400))
    seen = set()
    while seen != {"a", "b"}:
        seen |= {out.request_id for out in (await caller.call.read()).outputs}
    caller.send(abort("a"))
    while True:
        outputs = (await caller.call.read()).outputs
        if {out.request_id for out in outputs} == {"b"}:
            break
    info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert info.num_running == 1
    caller.call.cancel()
    await wait_idle(stub)


async def test_a_lost_executor_fails_the_call_with_unavailable(engine):
    stub, executor = engine
    caller = Caller(stub)
    caller.send(generate("long", 400))
    await caller.call.read()
    await executor.server.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        while await caller.call.read() is not grpc.aio.EOF:
            pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_stopping_scheduler_refuses_new_requests_on_open_calls():
    call = StreamCall(loop=None, draining=lambda: True)
    call.admit(generate("late", 4).generate, "trace-late")
    refusal = call.queue.get_nowait()
    assert (refusal.request_id, refusal.error_code) == ("late", grpc.StatusCode.UNAVAILABLE.value[0])
    assert refusal.error_message == SHUTTING_DOWN and not call.live
