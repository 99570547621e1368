"""The Engine service's Pool RPC over real sockets: the scheduler steps a pooling Worker (a tiny
sentence-transformers encoder) through the executor's gRPC service."""
import asyncio
from functools import partial

import grpc
import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from pagedserve.common import service
from pagedserve.common.config import EngineConfig
from pagedserve.executor_svc.server import ExecutorService
from pagedserve.executor_svc.worker import Worker
from pagedserve.scheduler_svc.engine_loop import EngineLoop
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.scheduler_svc.server import EngineService
from pagedserve.v1 import engine_pb2, engine_pb2_grpc, executor_pb2_grpc
from tests.tiny_encoders import make_sentence_transformer

TEXTS = ["what is the capital of france", "paris", "the city of berlin"]


async def test_pool_answers_embeddings_model_info_and_refusals(tmp_path):
    path = make_sentence_transformer(tmp_path / "st", matryoshka_dimensions=[64, 16])
    expected = SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_numpy=True)
    worker = Worker(EngineConfig(model=str(path), max_num_seqs=1))
    info = worker.describe()
    tokenizer = SentenceTransformer(str(path), device="cpu").tokenizer
    executor_address, engine_address = f"unix://{tmp_path}/executor.sock", f"unix://{tmp_path}/engine.sock"
    executor = await service.start("executor", executor_address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(worker)))
    config = EngineConfig(served_model_name=["st"], max_num_queued_reqs=1)
    async with service.channel(executor_address) as channel, service.channel(engine_address) as engine:
        loop = EngineLoop(Scheduler(config, info), executor_pb2_grpc.ExecutorStub(channel))
        server = await service.start("scheduler", engine_address, partial(
            engine_pb2_grpc.add_EngineServicer_to_server, EngineService(loop, config, info)))
        stub = engine_pb2_grpc.EngineStub(engine)

        def pool(i: int, **params) -> grpc.aio.UnaryUnaryCall:
            ids = tokenizer(TEXTS[i])["input_ids"]
            return stub.Pool(engine_pb2.PoolRequest(request_id=f"r{i}", prompt_token_ids=ids,
                                                    params=engine_pb2.PoolingParams(task="embed", **params)),
                             metadata=(("x-request-id", f"trace-{i}"),))

        # Before the loop steps: one request takes the running slot, one waits, the third (whichever
        # arrives last) is one too many.
        calls = [asyncio.ensure_future(pool(i)) for i in range(3)]
        await asyncio.sleep(0.2)
        stepping = asyncio.create_task(loop.run())
        replies = await asyncio.gather(*calls, return_exceptions=True)
        model_info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await pool(0, dimensions=8)
        truncated = await pool(1, dimensions=16, normalize=False)
        with pytest.raises(grpc.aio.AioRpcError) as ranked:
            await stub.Pool(engine_pb2.PoolRequest(request_id="ranked", prompt_token_ids=[5, 6], priority=1,
                                                   params=engine_pb2.PoolingParams(task="embed")))
        stepping.cancel()
        await server.stop()
    await executor.stop()
    refused = [i for i, r in enumerate(replies) if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 1 and replies[refused[0]].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for i in set(range(3)) - set(refused):
        np.testing.assert_allclose(replies[i].data, expected[i], atol=1e-4)
        assert replies[i].prompt_tokens == len(tokenizer(TEXTS[i])["input_ids"])
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[64, 16]" in bad.value.details()
    assert len(truncated.data) == 16
    # The priority reached the scheduler, which schedules first come, first served.
    assert ranked.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--scheduling-policy priority" in ranked.value.details()
    assert (model_info.runner, list(model_info.pooling_tasks), model_info.embedding_size) == ("pooling", ["embed"], 64)
    assert list(model_info.matryoshka_dimensions) == [64, 16] and model_info.is_matryoshka
    assert model_info.num_free_blocks == model_info.num_blocks
