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


@dataclass(slots=True)
class Gateway:
    engine: EngineClient
    tokenizer: Tokenizer
    metrics: Metrics = field(default_factory=Metrics)
    served_model_name: str | None = None
    stream_interval: int = 1
    # --tool-call-parser when --enable-auto-tool-choice is on (else None), and --reasoning-parser.
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    started: int = field(default_factory=lambda: int(time.time()))

    async def model(self) -> ServedModel:
        """The model clients address; raises a 503 APIError until the scheduler has answered once."""
        spec = await self.engine.model_spec()
        name = self.served_model_name or spec.served_model_name
        return ServedModel(name, spec, self.metrics.bind(name, spec.max_model_len))


GATEWAY = web.AppKey("gateway", Gateway)
