"""gRPC server around the scheduler core: the Engine service for gateways and backend services."""
import argparse
import asyncio
import gc
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from functools import partial

import grpc
import structlog
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from pagedserve.common import aio, service
from pagedserve.common.config import EngineConfig, flag_name
from pagedserve.common.log import get_logger
from pagedserve.common.plan import ExecutorInfo, info_from_proto
from pagedserve.common.pooling_params import pooling_from_proto
from pagedserve.common.sampling_params import SamplingParams, sampling_from_proto
from pagedserve.v1 import engine_pb2, engine_pb2_grpc, executor_pb2, executor_pb2_grpc
from pagedserve.scheduler_svc.engine_loop import EngineLoop, ExecutorLost
from pagedserve.scheduler_svc.generate_stream import StreamCall
from pagedserve.scheduler_svc.policy import num_interactive
from pagedserve.scheduler_svc.request import lora_adapters
from pagedserve.scheduler_svc.responses import refusal_code, response_from_outputs, status_code
from pagedserve.scheduler_svc.scheduler import QueueFull, Scheduler
from pagedserve.scheduler_svc.stats_logger import StatsLogger, interval_from_env
from pagedserve.scheduler_svc.step_stats import BUCKETS_US, Histogram

log = get_logger(__name__)

BUCKETS_S = [b / 1e6 for b in BUCKETS_US]
# Requests that may wait for a running slot, per slot, unless --max-num-queued-reqs says otherwise:
# four batches' worth keeps bursts (a benchmark's 4x oversubscription) queued, while a flood past it
# gets 503s with Retry-After at once rather than waiting without end.
DEFAULT_QUEUED_PER_SEQ = 4


def serving_scheduler(config: EngineConfig, info: ExecutorInfo) -> Scheduler:
    """The scheduler a server runs: its queue bounded by --max-num-queued-reqs, else by
    DEFAULT_QUEUED_PER_SEQ x max_num_seqs (the offline LLM queues every prompt it is given)."""
    limit = config.max_num_queued_reqs or DEFAULT_QUEUED_PER_SEQ * info.max_num_seqs
    return Scheduler(replace(config, max_num_queued_reqs=limit), info)


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, loop: EngineLoop, config: EngineConfig, info: ExecutorInfo) -> None:
        self.loop = loop
        self.config = config
        self.info = info
        # Set once the server stops: GenerateStream then refuses new requests, as the server
        # refuses new calls.
        self.draining = False

    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        _bind_trace_id(request, context)
        try:
            params = sampling_from_proto(request.params)
            _, queue = self.loop.add(request.request_id, list(request.prompt_token_ids), params,
                                     cache_salt=request.cache_salt, priority=request.priority,
                                     background=request.background, lora_name=request.lora_name)
        except (ValueError, QueueFull, ExecutorLost) as e:
            await context.abort(refusal_code(e), str(e))
        finished = False
        try:
            while not finished:
                # A stream that lags the engine by a few steps catches up in one message.
                outs = await aio.take_all(queue)
                lost = next((o for o in outs if isinstance(o, ExecutorLost)), None)
                if lost:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(lost))
                finished = outs[-1].finished
                if outs[-1].error is not None:
                    await context.abort(status_code(outs[-1].error_code), outs[-1].error)
                yield response_from_outputs(outs)
        finally:
            # Runs on cancellation too (client gone, deadline): the abort frees the request's blocks.
            if not finished:
                self.loop.abort(request.request_id)
            log.debug("request_finished" if finished else "request_aborted",
                      engine_request_id=request.request_id)

    async def Pool(self, request: engine_pb2.PoolRequest,
                   context: grpc.aio.ServicerContext) -> engine_pb2.PoolResponse:
        _bind_trace_id(request, context)
        try:
            _, queue = self.loop.add(request.request_id, list(request.prompt_token_ids), SamplingParams(),
                                     pooling=pooling_from_proto(request.params),
                                     token_type_ids=list(request.token_type_ids), priority=request.priority,
                                     background=request.background)
        except (ValueError, QueueFull, ExecutorLost) as e:
            await context.abort(refusal_code(e), str(e))
        finished = False
        try:
            out = await queue.get()
            finished = True
            if isinstance(out, ExecutorLost):
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(out))
            if out.error is not None:
                await context.abort(status_code(out.error_code), out.error)
            return engine_pb2.PoolResponse(data=out.pooled, prompt_tokens=out.num_prompt_tokens)
        finally:
            # Runs on cancellation too (client gone, deadline): the abort frees the request's blocks.
            if not finished:
                self.loop.abort(request.request_id)
            log.debug("request_finished" if finished else "request_aborted",
                      engine_request_id=request.request_id)

    async def GenerateStream(self, request_iterator: AsyncIterator[engine_pb2.StreamRequest],
                             context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.StreamResponse]:
        call = StreamCall(self.loop, lambda: self.draining)
        reading = asyncio.create_task(call.read(request_iterator))
        try:
            async for response in call.responses(context):
                yield response
        finally:
            reading.cancel()
            call.abort_all()

    async def Abort(self, request: engine_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        return engine_pb2.AbortResponse(found=self.loop.abort(request.request_id))

    async def GetModelInfo(self, request: engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.ModelInfo:
        s = self.loop.scheduler
        stats = s.stats
        return engine_pb2.ModelInfo(
            served_model_name=self.config.name, max_model_len=self.info.max_model_len,
            vocab_size=self.info.vocab_size, eos_token_ids=self.info.eos_token_ids,
            block_size=self.info.block_size, num_blocks=s.block_manager.num_usable_blocks,
            num_free_blocks=s.num_free_blocks, num_running=s.num_running,
            num_waiting=s.num_waiting, num_preemptions=s.num_preemptions, kv_cache_usage=s.kv_usage,
            num_background_running=len(s.running) - num_interactive(s.running),
            num_background_waiting=len(s.waiting_background),
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            enable_prefix_caching=self.config.enable_prefix_caching,
            gpu_memory_utilization=self.info.gpu_memory_utilization, max_logprobs=self.info.max_logprobs,
            cache_dtype=self.config.kv_cache_dtype, lora_names=self.info.lora_names, max_loras=self.info.max_loras,
            running_lora_adapters=lora_adapters(s.running),
            waiting_lora_adapters=lora_adapters([*s.waiting, *s.waiting_background]),
            step_schedule=histogram_to_proto(stats.scheduler),
            step_forward=histogram_to_proto(stats.forward), step_idle=histogram_to_proto(stats.idle),
            **_pooling_fields(self.info))


def _bind_trace_id(request: engine_pb2.GenerateRequest | engine_pb2.PoolRequest,
                   context: grpc.aio.ServicerContext) -> None:
    # Each RPC runs in its own task, so the bound id stays with this request's events.
    trace_id = dict(context.invocation_metadata() or ()).get("x-request-id", request.request_id)
    structlog.contextvars.bind_contextvars(request_id=trace_id)
    log.debug("request_received", engine_request_id=request.request_id,
              prompt_tokens=len(request.prompt_token_ids))


def _pooling_fields(info: ExecutorInfo) -> dict:
    """ModelInfo's fields about pooling, from the executor's Describe."""
    p = info.pooling
    return dict(runner=info.runner, pooling_tasks=p.tasks, embedding_size=p.embedding_size,
                matryoshka_dimensions=p.matryoshka_dimensions, is_matryoshka=p.is_matryoshka,
                num_labels=p.num_labels, default_prompt=p.default_prompt, labels=p.labels)


def histogram_to_proto(h: Histogram) -> engine_pb2.StepHistogram:
    return engine_pb2.StepHistogram(bucket_upper_bounds_s=BUCKETS_S, bucket_counts=h.counts, count=h.count,
                                    sum_s=h.sum_ns / 1e9)


class ExecutorMismatch(Exception):
    """The executor disagrees with a geometry flag, or came back serving another model."""


@dataclass(slots=True)
class ExecutorLink:
    """The executor the scheduler plans for: where it is, the geometry flags the scheduler was given
    (each must match the executor's), and what it described when the scheduler first attached."""
    stub: executor_pb2_grpc.ExecutorStub
    address: str
    expected: dict[str, int | str]
    planned: ExecutorInfo | None = None

    async def describe(self) -> ExecutorInfo:
        """The executor's Describe once it is serving; raises ExecutorMismatch if it disagrees with
        the flags or, after a restart, with what the scheduler and its gateways planned with."""
        while True:
            await service.wait_serving(self.address, math.inf)
            try:
                info = info_from_proto(await self.stub.Describe(executor_pb2.DescribeRequest(), timeout=10,
                                                                metadata=service.call_metadata()))
                break
            except grpc.aio.AioRpcError as e:
                log.warning("executor_describe_failed", address=self.address, code=e.code().name)
                await asyncio.sleep(1)
        check_geometry(self.expected, info, self.address)
        if self.planned is not None:
            check_same_model(self.planned, info, self.address)
        self.planned = self.planned or info
        return info


async def serve(config: EngineConfig, address: str, executor_address: str,
                expected: dict[str, int | str] | None = None) -> None:
    """Attaches to the executor once it serves, however long it takes to load, then serves the
    Engine service at `address` until a signal. When the executor is lost it fails what was running,
    reports NOT_SERVING and reattaches once the executor is back. `expected` holds geometry flags
    the scheduler was given."""
    try:
        await _serve(config, address, executor_address, expected or {})
    except ExecutorMismatch as e:
        raise SystemExit(f"scheduler: {e}") from None


async def _serve(config: EngineConfig, address: str, executor_address: str, expected: dict[str, int | str]) -> None:
    async with service.channel(executor_address) as channel:
        link = ExecutorLink(executor_pb2_grpc.ExecutorStub(channel), executor_address, expected)
        info = await link.describe()
        loop = EngineLoop(serving_scheduler(config, info), link.stub, config.async_scheduling)
        # The block pool and everything loaded so far live as long as the process: frozen, they
        # leave the collector's full passes, which took ~30 ms (a stalled step) at 18k blocks.
        gc.freeze()
        engine = EngineService(loop, config, info)
        running = await service.start("scheduler", address, partial(engine_pb2_grpc.add_EngineServicer_to_server,
                                                                    engine))
        log.info("scheduler_ready", address=address, num_blocks=info.num_blocks,
                 block_size=info.block_size, max_model_len=info.max_model_len,
                 max_num_seqs=info.max_num_seqs, max_num_batched_tokens=info.max_num_batched_tokens)
        stepping = asyncio.create_task(step_and_reattach(loop, link, config, running.health))
        signalled = asyncio.create_task(service.wait_for_signal())
        stats = None if config.disable_log_stats else asyncio.create_task(
            StatsLogger(loop, interval_from_env()).run())
        try:
            done, _ = await asyncio.wait({stepping, signalled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            engine.draining = True
            await running.stop()
            stepping.cancel()
            signalled.cancel()
            if stats is not None:
                stats.cancel()
        if stepping in done:
            stepping.result()


async def step_and_reattach(loop: EngineLoop, link: ExecutorLink, config: EngineConfig,
                            health: health_aio.HealthServicer) -> None:
    """Steps; each time the executor is lost, waits for it to come back and serves again."""
    while True:
        await loop.run()
        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        log.warning("executor_reattaching", address=link.address)
        info = await link.describe()
        loop.reset(serving_scheduler(config, info))
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("executor_reattached", address=link.address, num_blocks=info.num_blocks)


def check_geometry(expected: dict[str, int | str], info: ExecutorInfo, executor_address: str) -> None:
    """Refuses a geometry flag that disagrees with the executor's KV cache: planning
    with another block size corrupts the slot mapping and, with prefix caching, shared blocks."""
    reported = {"block_size": info.block_size, "max_model_len": info.max_model_len,
                "num_gpu_blocks_override": info.num_blocks, "dtype": info.dtype,
                "max_num_seqs": info.max_num_seqs, "max_num_batched_tokens": info.max_num_batched_tokens}
    for name, value in expected.items():
        if value != reported[name] and not (name == "dtype" and value == "auto"):
            flag = flag_name(name)
            raise ExecutorMismatch(f"{flag} {value} disagrees with the executor at {executor_address}, "
                                   f"which reports {reported[name]}; drop {flag} (the scheduler takes "
                                   f"the executor's) or start the executor with {flag} {value}")


# What the scheduler and its gateways keep from the first Describe; the number of blocks may change.
MODEL_FACTS = ("block_size", "dtype", "vocab_size", "max_model_len", "eos_token_ids", "runner", "pooling")


def check_same_model(planned: ExecutorInfo, info: ExecutorInfo, executor_address: str) -> None:
    """Refuses a restarted executor that serves another model or geometry than the one planned with."""
    for name in MODEL_FACTS:
        before, now = getattr(planned, name), getattr(info, name)
        if before != now:
            raise ExecutorMismatch(f"the executor at {executor_address} came back with {name} {now}, not "
                                   f"{before} as before; restart the scheduler and its gateways to serve it")


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="127.0.0.1:50051",
                        help="where the Engine service listens (host:port or unix:///path)")
    parser.add_argument("--executor-address", default="127.0.0.1:50052")
