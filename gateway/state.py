"""What the handlers share: the engine connection, the tokenizer, the metrics and the served name."""
import time
from dataclasses import dataclass, field

from aiohttp import web

from pagedserve.gateway.engine_client import EngineClient, ModelSpec
from pagedserve.gateway.metrics import Metrics, ModelMetrics
from pagedserve.common.tokenizer import Tokenizer


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
    engine: EngineClient
    tokenizer: Tokenizer
    metrics: Metrics = field(default_factory=Metrics)
    # --served-model-name: overrides the scheduler's name; every one is accepted as `model`.
    served_model_names: list[str] = field(default_factory=list)
    stream_interval: int = 1
    log_requests: bool = False
    sampling_defaults: dict = field(default_factory=dict)
    # --tool-call-parser when --enable-auto-tool-choice is on (else None), and --reasoning-parser.
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    started: int = field(default_factory=lambda: int(time.time()))

    async def model(self) -> ServedModel:
        """The model clients address; raises a 503 APIError until the scheduler has answered once."""
        spec = await self.engine.model_spec()
        names = tuple(self.served_model_names) or (spec.served_model_name,)
        return ServedModel(names[0], spec, self.metrics.bind(names[0], spec.max_model_len),
                           self.sampling_defaults, names)


GATEWAY = web.AppKey("gateway", Gateway)
