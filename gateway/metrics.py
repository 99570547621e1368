"""Prometheus metrics under vLLM's names with the `pagedserve:` prefix, labelled by model_name."""
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                            Metric)
from prometheus_client.utils import floatToGoString

from pagedserve.v1 import engine_pb2 as pb

# vLLM's buckets, so that dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length")
REJECT_REASONS = ("queue_full", "too_long", "invalid")
# The pooling routes, by the label their series carry: /v1/embeddings, the /rerank, /score and /classify routes.
POOLING_ENDPOINTS = ("embeddings", "rerank", "score", "classify")
# ModelInfo field, metric name and help of the scheduler's per-step histograms.
STEP_HISTOGRAMS = (
    ("step_schedule", "step_schedule_seconds", "Scheduler CPU seconds per step (schedule and update)."),
    ("step_forward", "step_forward_seconds", "Executor forward seconds per step."),
    ("step_idle", "step_idle_seconds", "Executor idle seconds between consecutive steps."))

# The scheduler series: name, ModelInfo field, help.
ENGINE_GAUGES = (
    ("num_requests_running", "num_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("num_background_requests_running", "num_background_running",
     "Background (batch) requests in the running batch, of num_requests_running."),
    ("num_background_requests_waiting", "num_background_waiting",
     "Background (batch) requests waiting to be scheduled, of num_requests_waiting."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Share of KV-cache blocks in use (0 to 1)."))
ENGINE_COUNTERS = (
    ("num_preemptions", "num_preemptions", "Preemptions since the scheduler started."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."))
ENGINE_LABELS = ["model_name", "engine"]
CACHE_CONFIG = ["block_size", "num_gpu_blocks", "gpu_memory_utilization", "enable_prefix_caching", "cache_dtype"]
LORA_INFO = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
# The series vLLM has too, by pagedserve name: their vllm: names (kv_cache_usage_perc also under the
# name vLLM had before, which vLLM production-stack's router still reads).
VLLM_TWINS = {name: (name,) for name in (
    "num_requests_running", "num_requests_waiting", "num_preemptions", "prefix_cache_queries",
    "prefix_cache_hits", "cache_config_info", "lora_requests_info", "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens", "request_params_n",
    "request_params_max_tokens", "prompt_tokens", "generation_tokens", "request_success")}
VLLM_TWINS["kv_cache_usage_perc"] = ("kv_cache_usage_perc", "gpu_cache_usage_perc")

# The *_created series double what a scrape carries and nothing reads them (vLLM turns them off too).
prometheus_client.disable_created_metrics()


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return buckets
            buckets.append(step * scale)
        scale *= 10


@dataclass(slots=True)
class ModelMetrics:
    """One model's series, bound to its label once so that the hot path does no label lookups."""
    time_to_first_token: Histogram
    # Batch lines' (background requests'): time_to_first_token keeps vLLM's meaning, interactive requests.
    batch_time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    request_params_n: Histogram
    request_params_max_tokens: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    request_success: dict[str, Counter]
    client_disconnected: Counter
    request_rejected: dict[str, Counter]
    pooling_requests: dict[str, Counter]
    pooling_prompt_tokens: dict[str, Counter]


def _create(registry: CollectorRegistry, model_name: str, max_model_len: int) -> ModelMetrics:
    def histogram(name: str, doc: str, buckets) -> Histogram:
        return Histogram(f"pagedserve:{name}", doc, ["model_name"], registry=registry,
                         buckets=buckets).labels(model_name)

    def counters(name: str, doc: str, label: str, values: tuple[str, ...]) -> dict[str, Counter]:
        family = Counter(f"pagedserve:{name}", doc, ["model_name", label], registry=registry)
        return {v: family.labels(model_name, v) for v in values}

    tokens = token_buckets(max_model_len)
    return ModelMetrics(
        time_to_first_token=histogram("time_to_first_token_seconds",
                                      "Seconds from request arrival to its first token.", TTFT_BUCKETS),
        batch_time_to_first_token=histogram("batch_time_to_first_token_seconds",
                                            "Seconds from a batch line's start to its first token.",
                                            TTFT_BUCKETS),
        inter_token_latency=histogram("inter_token_latency_seconds",
                                      "Seconds between consecutive token responses.", ITL_BUCKETS),
        e2e_request_latency=histogram("e2e_request_latency_seconds",
                                      "Seconds from request arrival to its finish.", E2E_BUCKETS),
        request_prompt_tokens=histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                        tokens),
        request_generation_tokens=histogram("request_generation_tokens",
                                            "Generated tokens per finished request.", tokens),
        request_params_n=histogram("request_params_n", "The n parameter of accepted requests.",
                                   N_BUCKETS),
        request_params_max_tokens=histogram("request_params_max_tokens",
                                            "The effective max_tokens of accepted requests.", tokens),
        prompt_tokens=Counter("pagedserve:prompt_tokens", "Prefilled prompt tokens.", ["model_name"],
                              registry=registry).labels(model_name),
        generation_tokens=Counter("pagedserve:generation_tokens", "Generated tokens.", ["model_name"],
                                  registry=registry).labels(model_name),
        request_success=counters("request_success", "Requests that finished.", "finished_reason",
                                 FINISH_REASONS),
        client_disconnected=Counter("pagedserve:http_requests_client_disconnected",
                                    "Requests whose client left before they finished.", ["model_name"],
                                    registry=registry).labels(model_name),
        request_rejected=counters("request_rejected", "Requests refused before generation.", "reason",
                                  REJECT_REASONS),
        pooling_requests=counters("pooling_requests", "Pooling requests that finished, by endpoint.", "endpoint",
                                  POOLING_ENDPOINTS),
        pooling_prompt_tokens=counters("pooling_prompt_tokens", "Prompt tokens of finished pooling requests, by "
                                       "endpoint (also counted in prompt_tokens).", "endpoint", POOLING_ENDPOINTS),
    )


class ChoiceStats:
    """Latencies and token counts of one engine request, recorded as its responses arrive."""
    __slots__ = ("_m", "_arrival", "_last", "_first_token")

    def __init__(self, metrics: ModelMetrics, arrival: float, background: bool = False) -> None:
        self._m = metrics
        self._arrival = arrival
        self._last: float | None = None
        self._first_token = metrics.batch_time_to_first_token if background else metrics.time_to_first_token

    def response(self) -> None:
        now = time.monotonic()
        if self._last is None:
            self._first_token.observe(now - self._arrival)
        else:
            self._m.inter_token_latency.observe(now - self._last)
        self._last = now

    def end(self, finish_reason: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        """finish_reason is None when the request did not finish (cancelled or failed); prompt_tokens
        is 0 for the choices that share another choice's prompt (n > 1)."""
        m = self._m
        if self._last is not None:
            m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(completion_tokens)
        if finish_reason is None:
            return
        m.e2e_request_latency.observe(time.monotonic() - self._arrival)
        m.request_success[finish_reason].inc()
        m.request_generation_tokens.observe(completion_tokens)
        if prompt_tokens:
            m.request_prompt_tokens.observe(prompt_tokens)


def rejection_reason(status: int, code: str | None) -> str | None:
    """The request_rejected reason of an error answered before generation; None if not a rejection."""
    if status == 413 or code == "context_length_exceeded":
        return "too_long"
    if code == "server_overloaded":
        return "queue_full"
    return "invalid" if 400 <= status < 500 else None


class _EngineCollector:
    """Each scheduler's series, labelled by the model it serves and engine="0", "1", ... in its
    model's address order (as vLLM labels its data-parallel engines), from the ModelInfos fetched
    for the scrape being rendered."""

    def __init__(self) -> None:
        self.infos: list[tuple[str, list[pb.ModelInfo | None]]] = []

    def collect(self) -> Iterator[Metric]:
        engines = [(model, str(i), info) for model, infos in self.infos
                   for i, info in enumerate(infos) if info is not None]
        if not engines:
            return
        for kind, series in ((GaugeMetricFamily, ENGINE_GAUGES), (CounterMetricFamily, ENGINE_COUNTERS)):
            for name, field, doc in series:
                family = kind(f"pagedserve:{name}", doc, labels=ENGINE_LABELS)
                for model, engine, info in engines:
                    family.add_metric([model, engine], getattr(info, field))
                yield family
        family = GaugeMetricFamily("pagedserve:cache_config_info", "KV-cache configuration.",
                                   labels=[*ENGINE_LABELS, *CACHE_CONFIG])
        for model, engine, info in engines:
            family.add_metric([model, engine, *_cache_config(info)], 1)
        yield family
        yield from _lora_info([e for e in engines if e[2].max_loras])
        for field, name, doc in STEP_HISTOGRAMS:
            # An Engine that does not time its steps leaves them out, and a histogram needs its buckets.
            timed = [(model, engine, info) for model, engine, info in engines if info.HasField(field)]
            if timed:
                yield _histogram(f"pagedserve:{name}", doc, timed, field)


class _ModelSeries:
    """The gateway's own series of every model, each name one family holding every model's samples.
    Each model has its own registry, since a token histogram's buckets follow its max_model_len."""

    def __init__(self) -> None:
        self.registries: list[CollectorRegistry] = []

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                merged = families.setdefault(family.name, family)
                if merged is not family:
                    merged.samples += family.samples
        yield from families.values()


def _cache_config(info: pb.ModelInfo) -> list[str]:
    return [str(info.block_size), str(info.num_blocks), str(round(info.gpu_memory_utilization, 4)),
            str(info.enable_prefix_caching), info.cache_dtype]


def _lora_info(engines: list[tuple[str, str, pb.ModelInfo]]) -> Iterator[Metric]:
    """vLLM's lora_requests_info of schedulers with LoRA on: the adapters running and waiting as
    comma-joined labels, its value the time of the scrape (vLLM's, the time of its last update)."""
    if not engines:
        return
    family = GaugeMetricFamily("pagedserve:lora_requests_info", "Running and waiting LoRA adapters.",
                               labels=[*ENGINE_LABELS, *LORA_INFO])
    now = time.time()
    for model, engine, info in engines:
        family.add_metric([model, engine, str(info.max_loras), ",".join(info.running_lora_adapters),
                           ",".join(info.waiting_lora_adapters)], now)
    yield family


def _histogram(name: str, doc: str, engines: list[tuple[str, str, pb.ModelInfo]], field: str) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=ENGINE_LABELS)
    for model, engine, info in engines:
        h = getattr(info, field)
        bounds = [floatToGoString(b) for b in h.bucket_upper_bounds_s] + ["+Inf"]
        family.add_metric([model, engine], list(zip(bounds, accumulate(h.bucket_counts))), h.sum_s)
    return family


class _VllmTwins:
    """Every series of `source`, and beside each one vLLM names too, a copy under those names:
    routers and dashboards built for vLLM read them unchanged."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            yield family
            for name in VLLM_TWINS.get(family.name.removeprefix("pagedserve:"), ()):
                yield _renamed(family, f"vllm:{name}")


def _renamed(family: Metric, name: str) -> Metric:
    twin = Metric(name, family.documentation, family.type, family.unit)
    twin.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
    return twin


@dataclass(slots=True)
class BatchMetrics:
    """The Batch API's series, of every model: lines waiting for a slot and running, and their tokens."""
    lines: dict[str, Gauge]
    prompt_tokens: Counter
    generation_tokens: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> "BatchMetrics":
        lines = Gauge("pagedserve:batch_lines", "Lines of running batches, queued for a slot or running.",
                      ["state"], registry=registry)
        return cls({state: lines.labels(state) for state in ("queued", "running")},
                   Counter("pagedserve:batch_prompt_tokens", "Prompt tokens of answered batch lines.",
                           registry=registry),
                   Counter("pagedserve:batch_generation_tokens", "Generated tokens of answered batch lines.",
                           registry=registry))


class Metrics:
    """The gateway's registry: its own series and, at scrape time, the schedulers'; each under its
    pagedserve: name and, where vLLM has the series, its vllm: name too."""

    def __init__(self) -> None:
        self._own = CollectorRegistry()
        self.batch = BatchMetrics.create(self._own)
        self._engine = _EngineCollector()
        self._models = _ModelSeries()
        self._own.register(self._engine)
        self._own.register(self._models)
        self.registry = CollectorRegistry()
        self.registry.register(_VllmTwins(self._own))
        self._bound: dict[str, ModelMetrics] = {}

    def bind(self, model_name: str, max_model_len: int) -> ModelMetrics:
        """The model's series, created on first use (their token buckets depend on max_model_len)."""
        if model_name not in self._bound:
            registry = CollectorRegistry()
            self._models.registries.append(registry)
            self._bound[model_name] = _create(registry, model_name, max_model_len)
        return self._bound[model_name]

    def render(self, infos: list[tuple[str, list[pb.ModelInfo | None]]], accept: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type; `infos` holds each model's name and its engines'
        ModelInfos, None leaving an engine's series out."""
        encoder, content_type = choose_encoder(accept)
        self._engine.infos = infos
        return encoder(self.registry), content_type
