"""Async client for the scheduler's pagedserve.v1.Engine gRPC service."""
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.gateway.engine_stream import EngineStream
from pagedserve.gateway.errors import APIError, Unavailable, bad_request, internal, overloaded
from pagedserve.common import service
from pagedserve.common.sampling_params import MAX_LOGPROBS
from pagedserve.v1 import engine_pb2 as pb
from pagedserve.v1 import sampling_pb2
from pagedserve.v1.engine_pb2_grpc import EngineStub


@dataclass(slots=True, frozen=True)
class Routing:
    """What the scheduler uses to place a request besides its tokens: `cache_salt` keeps its
    prefix-cache blocks from requests with another salt; `priority` (vLLM's, lower first) and
    `background` (batch work, which runs on the capacity interactive requests leave) rank it;
    `lora_name` is the LoRA adapter it runs with (empty: the base model)."""
    cache_salt: str | None = None
    priority: int = 0
    background: bool = False
    lora_name: str = ""


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """The parts of ModelInfo that never change while the scheduler runs."""
    served_model_name: str
    max_model_len: int
    vocab_size: int
    # "generate" or "pooling" (a scheduler that does not say runs generate), and a pooling model's facts.
    runner: str = "generate"
    pooling_tasks: tuple[str, ...] = ()
    embedding_size: int = 0
    matryoshka_dimensions: tuple[int, ...] = ()
    is_matryoshka: bool = False
    num_labels: int = 0
    default_prompt: str = ""
    labels: tuple[str, ...] = ()
    # The most top logprobs a request may ask for per token (the engine's --max-logprobs).
    max_logprobs: int = MAX_LOGPROBS
    # The LoRA adapters a request may name as its `model` (the engine's --lora-modules).
    lora_names: tuple[str, ...] = ()

    @classmethod
    def of(cls, info: pb.ModelInfo) -> "ModelSpec":
        return cls(info.served_model_name, info.max_model_len, info.vocab_size, info.runner or "generate",
                   tuple(info.pooling_tasks), info.embedding_size, tuple(info.matryoshka_dimensions),
                   info.is_matryoshka, info.num_labels, info.default_prompt, tuple(info.labels),
                   info.max_logprobs, tuple(info.lora_names))


# A call the gateway cancels itself never raises (a client that leaves cancels the handler), so a
# CANCELLED here is the scheduler's: it stopped, restarted or shed the call.
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.ABORTED)


class SchedulerDown(Unavailable):
    """The scheduler is unreachable, not serving, or dropped the call: it leaves the rotation."""


def api_error(code: grpc.StatusCode, details: str | None) -> APIError:
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return bad_request(details or "The scheduler rejected the request.")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return overloaded()
    if code in _UNAVAILABLE:
        # Details name socket addresses, which a client must not see.
        return SchedulerDown("The scheduler is unavailable; retry shortly.")
    return internal(f"The scheduler failed the request ({code.name}).")


class EngineClient:
    """Calls GenerateStream, Pool, GetModelInfo and health on `address` (host:port or unix:///path)."""

    def __init__(self, address: str) -> None:
        self._channel = service.channel(address)
        self._stub = EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._stream: EngineStream | None = None

    async def check_serving(self, timeout: float = 2.0) -> None:
        """Raises a 503 APIError unless the scheduler's health service reports SERVING (it does not
        while it starts, stops or reattaches to its executor)."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise api_error(e.code(), e.details()) from e
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise SchedulerDown("The scheduler is not serving (it is starting, stopping or reconnecting to its "
                              "executor); retry shortly.")

    async def model_info(self, timeout: float = 2.0) -> pb.ModelInfo:
        """Fresh ModelInfo, live counters included; raises a 503 APIError if the scheduler is down."""
        try:
            return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout,
                                                  metadata=service.call_metadata())
        except grpc.aio.AioRpcError as e:
            raise api_error(e.code(), e.details()) from e

    async def pool(self, request: pb.PoolRequest, trace_id: str) -> pb.PoolResponse:
        """One input's pooled data (a Pool call); raises the APIError of the scheduler's status.
        Cancelling the call aborts the request on the scheduler."""
        metadata = (*(service.call_metadata() or ()), ("x-request-id", trace_id))
        try:
            return await self._stub.Pool(request, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise api_error(e.code(), e.details()) from e

    def start(self, request_id: str, prompt_token_ids: list[int], params: sampling_pb2.SamplingParams,
              trace_id: str, deliver: Callable[[pb.GenerateResponse | APIError], None],
              routing: Routing = Routing()) -> None:
        """Sends a request on the scheduler's shared GenerateStream call: `deliver` receives each of
        its responses, and an APIError last if the scheduler refused or failed it. `trace_id` is the
        HTTP X-Request-Id, which the scheduler logs with it."""
        request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, params=params,
                                     cache_salt=routing.cache_salt or "", priority=routing.priority,
                                     background=routing.background, lora_name=routing.lora_name)
        self._open_stream().open(request, trace_id, deliver,
                                 lambda failed: deliver(api_error(failed.code, failed.details)))

    def stop(self, request_id: str) -> None:
        """Ends a request started here: one still running is aborted on the scheduler."""
        if self._stream is not None:
            self._stream.close(request_id)

    def _open_stream(self) -> EngineStream:
        # A broken call has failed its requests; the next request opens another.
        if self._stream is None or self._stream.error is not None:
            self._stream = EngineStream(self._stub)
        return self._stream

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
        await self._channel.close()
