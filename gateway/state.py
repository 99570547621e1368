"""What the handlers share: each model's schedulers, tokenizer and names, the metrics, the
limits, the shutdown drain, and the pool that keeps large inputs off the event loop."""
import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TypeVar

from aiohttp import web

from pagedserve.gateway.drain import Drain
from pagedserve.gateway.engine_client import ModelSpec
from pagedserve.gateway.engine_pool import EnginePool
from pagedserve.gateway.generation import RequestLog
from pagedserve.gateway.errors import APIError, bad_request, model_not_found
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


@dataclass(slots=True)
class ModelEngines:
    """One model as this gateway was told of it: the schedulers serving it (its replicas), its
    tokenizer, the names clients may send for it, and its sampling defaults."""
    engines: EnginePool
    tokenizer: Tokenizer
    # --served-model-name: overrides the scheduler's name; every one is accepted as `model`.
    served_model_names: list[str] = field(default_factory=list)
    sampling_defaults: dict = field(default_factory=dict)
    # generation_config.max_tokens_cap: the most max_tokens any request gets.
    max_tokens_cap: int | None = None

    def names(self) -> tuple[str, ...]:
        """Every name clients may send for it; none until its schedulers have answered, unless given."""
        if self.served_model_names:
            return tuple(self.served_model_names)
        return (self.engines.spec.served_model_name,) if self.engines.spec else ()

    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters clients may name instead; none until its schedulers have answered."""
        return self.engines.spec.lora_names if self.engines.spec else ()


@dataclass(slots=True, frozen=True)
class ServedModel:
    """The model a request addresses, with all a route needs to serve it."""
    name: str
    # Every name clients may send as `model`; responses report `name`, the first.
    aliases: tuple[str, ...]
    spec: ModelSpec
    tokenizer: Tokenizer
    engines: EnginePool
    metrics: ModelMetrics
    sampling_defaults: dict
    max_tokens_cap: int | None
    # The LoRA adapter the request named as its `model` (then `name`); empty: the model itself.
    lora_name: str = ""

    def named(self, requested: str | None) -> "ServedModel | None":
        """This model as `requested` names it: itself for any of its names (or none), with the adapter
        for an adapter's name; None for a name it does not have."""
        if not requested or requested in self.aliases:
            return self
        if requested in self.spec.lora_names:
            return replace(self, name=requested, lora_name=requested)
        return None


@dataclass(slots=True)
class Gateway:
    # The main model (the positional model, at --scheduler-address) first, then each --also-serve.
    models: list[ModelEngines]
    metrics: Metrics = field(default_factory=Metrics)
    stream_interval: int = 1
    request_log: RequestLog = RequestLog()
    # --enable-prompt-tokens-details: usage reports cached_tokens.
    prompt_tokens_details: bool = False
    # --enable-force-include-usage: every stream ends with its usage, asked for or not.
    force_include_usage: bool = False
    # --chat-template-content-format: "string", "openai", or "auto" (what each template expects).
    content_format: str = "auto"
    # --response-role: the role replies to a chat that asked for a new turn are written as.
    response_role: str = "assistant"
    # --return-tokens-as-token-ids: logprobs name tokens "token_id:N" unless a request says otherwise.
    return_tokens_as_token_ids: bool = False
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

    async def served_for(self, requested: str | None) -> ServedModel:
        """The model a request's `model` names (any of its names; omitted: the only one served).
        Raises an APIError: 503 until its schedulers have answered, 404 for a name no model has,
        400 for none while several models are served."""
        if len(self.models) == 1 or not requested:
            return await self._only(requested)
        return await self._named(requested)

    async def served_models(self) -> list[ServedModel]:
        """Every model whose schedulers have answered, main model first; a 503 APIError while none has."""
        found = [await self._try_served(model) for model in self.models]
        served = [s for s in found if isinstance(s, ServedModel)]
        if not served:
            raise found[0]
        return served

    async def _only(self, requested: str | None) -> ServedModel:
        if len(self.models) > 1:
            raise bad_request("This server serves several models; name one in `model` (GET /v1/models lists "
                              "them).", param="model")
        served = (await self._served(self.models[0])).named(requested)
        if served is None:
            raise model_not_found(requested)
        return served

    async def _named(self, requested: str) -> ServedModel:
        for model in self.models:
            if requested in model.names() + model.lora_names():
                return (await self._served(model)).named(requested)
        # Only now the models whose names are not known yet, since their schedulers have not answered:
        # the first of their 503s if none of them has the name either.
        unknown = [m for m in self.models if not m.names()]
        found = [await self._try_served(model) for model in unknown]
        named = [n for s in found if isinstance(s, ServedModel) and (n := s.named(requested)) is not None]
        if named:
            return named[0]
        raise next((e for e in found if isinstance(e, APIError)), model_not_found(requested))

    async def _try_served(self, model: ModelEngines) -> ServedModel | APIError:
        try:
            return await self._served(model)
        except APIError as e:
            return e

    async def _served(self, model: ModelEngines) -> ServedModel:
        spec = await model.engines.model_spec()
        names = model.names()
        return ServedModel(names[0], names, spec, model.tokenizer, model.engines,
                           self.metrics.bind(names[0], spec.max_model_len), model.sampling_defaults,
                           model.max_tokens_cap)

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
# The model a request addressed, once known: its rejections count under its name.
SERVED = web.RequestKey("served", ServedModel)
