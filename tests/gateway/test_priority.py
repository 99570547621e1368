"""A chat request's `priority` through the gateway to the real scheduler (on a null executor): a
nonzero one under --scheduling-policy fcfs is a 400 naming the flag; under priority it is served."""
import asyncio
from functools import partial

import openai
import pytest

from pagedserve.common import service
from pagedserve.common.config import EngineConfig
from pagedserve.executor_svc.null_worker import NullWorker, null_executor_info
from pagedserve.executor_svc.server import ExecutorService
from pagedserve.scheduler_svc.server import serve
from pagedserve.v1 import executor_pb2_grpc
from tests.gateway.fake_engine import MODEL, serve_live_gateway

CHAT = [{"role": "user", "content": "Say hello"}]


@pytest.fixture
async def start_stack(tmp_path, tokenizer):
    """Starts an executor, a scheduler with the given policy and a gateway; returns an SDK client."""
    stopping = []

    async def start(policy: str) -> openai.AsyncOpenAI:
        executor_address = f"unix://{tmp_path}/executor-{policy}.sock"
        address = f"unix://{tmp_path}/engine-{policy}.sock"
        executor = await service.start("executor", executor_address, partial(
            executor_pb2_grpc.add_ExecutorServicer_to_server,
            ExecutorService(NullWorker(null_executor_info(num_blocks=64, block_size=16, max_model_len=256)))))
        config = EngineConfig(served_model_name=[MODEL], scheduling_policy=policy)
        serving = asyncio.create_task(serve(config, address, executor_address))
        await service.wait_serving(address, timeout=10)
        runner, url = await serve_live_gateway(tokenizer, address)
        stopping.append((runner, serving, executor))
        return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    yield start
    for runner, serving, executor in stopping:
        await runner.cleanup()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await executor.server.stop(0)


async def test_a_nonzero_priority_is_a_400_under_fcfs_and_served_under_priority(start_stack):
    fcfs = await start_stack("fcfs")
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority") as refused:
        await fcfs.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, extra_body={"priority": 2})
    assert "priority 2" in refused.value.body["message"]
    reply = await fcfs.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, extra_body={"priority": 0})
    assert reply.usage.completion_tokens == 3
    by_priority = await start_stack("priority")
    reply = await by_priority.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                                      extra_body={"priority": -5})
    assert reply.usage.completion_tokens == 3
