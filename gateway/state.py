"""What the handlers share: the schedulers, the tokenizer, the metrics, the served name, the
limits, the shutdown drain, and the pool that keeps large inputs off the event loop."""
import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from pagedserve.gateway.drain import Drain
from pagedserve.gateway.engine_client import ModelSpec
from pagedserve.gateway.engine_pool import EnginePool
from pagedserve.gateway.metrics import Metrics, ModelMetrics
from pagedserve.gateway.response_store import ResponseStore
from pagedserve.gateway.template_worker import TemplateWorker
from pagedserve.common.tokenizer import Tokenizer

T = TypeVar("T")
# Characters (or token ids) above which templating, tokenizing or detokenizing moves to the pool:
# about a millisecond of work, less than what a thread hop would cost below it.
OFFLOAD_SIZE = 16_384
DEFAULT_MAX_CLIENT_BATCH_SIZE = 1024
DEFAULT_BODY_READ_TIMEOUT_S = 60.0


@dataclass(slots=True, frozen=True)
class ServedModel:
    name: str
    spec: ModelSpec
    metrics: ModelMetrics
    sampling_defaults: dict
    # Every name clients may send as `model`; responses report `name`, the first.
    aliases: tuple[str, ...] = ()

    def resolve(self, requested: str | None) -> str | None:
        """The served name for an alias; any other name as it was given."""
        return self.name if requested in self.aliases else requested


@dataclass(slots=True)
class Gateway:
    engines: EnginePool
    tokenizer: Tokenizer
    metrics: Metrics = field(default_factory=Metrics)
    # --served-model-name: overrides the scheduler's name; every one is accepted as `model`.
    served_model_names: list[str] = field(default_factory=list)
    stream_interval: int = 1
    log_requests: bool = False
    # --enable-prompt-tokens-details: usage reports cached_tokens.
    prompt_tokens_details: bool = False
    sampling_defaults: dict = field(default_factory=dict)
    # --tool-call-parser when --enable-auto-tool-choice is on (else None), and --reasoning-parser.
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    # The most engine requests (prompts x n) one HTTP request may fan out to.
    max_client_batch_size: int = DEFAULT_MAX_CLIENT_BATCH_SIZE
    body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT_S
    # --max-concurrent-requests (None: no limit), and the generation requests in flight.
    max_concurrent_requests: int | None = None
    generating: int = 0
    # --trust-request-chat-template: requests may bring a chat template, rendered by `templates`.
    trust_request_chat_template: bool = False
    templates: TemplateWorker = field(default_factory=TemplateWorker)
    drain: Drain = field(default_factory=Drain)
    # Stored /v1/responses responses (--responses-store-mb, --responses-store-ttl).
    responses: ResponseStore = field(default_factory=ResponseStore)
    # One thread: the work is mostly Python (templates, ids to lists) that holds the GIL anyway, and
    # each extra thread would get its own malloc arena that keeps a large request's memory.
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "gateway-cpu"))
    started: int = field(default_factory=lambda: int(time.time()))

    async def model(self) -> ServedModel:
        """The model clients address; raises a 503 APIError until a scheduler has answered once."""
        spec = await self.engines.model_spec()
        names = tuple(self.served_model_names) or (spec.served_model_name,)
        return ServedModel(names[0], spec, self.metrics.bind(names[0], spec.max_model_len),
                           self.sampling_defaults, names)

    async def offload(self, size: int, fn: Callable[..., T], *args) -> T:
        """fn(*args): inline for small inputs, on the pool when `size` (characters or token ids)
        would hold the event loop long enough to delay /health and other streams."""
        if size < OFFLOAD_SIZE:
            return fn(*args)
        return await self.in_pool(fn, *args)

    async def in_pool(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the pool, whatever the size."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


GATEWAY = web.AppKey("gateway", Gateway)
