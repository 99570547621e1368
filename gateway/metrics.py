"""Prometheus metrics under vLLM's names with the `pagedserve:` prefix, labelled by model_name."""
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
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
# ModelInfo field, metric name and help of the scheduler's per-step histograms.
STEP_HISTOGRAMS = (
    ("step_schedule", "step_schedule_seconds", "Scheduler CPU seconds per step (schedule and update)."),
    ("step_forward", "step_forward_seconds", "Executor forward seconds per step."),
    ("step_idle", "step_idle_seconds", "Executor idle seconds between consecutive steps."))

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
    )


class ChoiceStats:
    """Latencies and token counts of one engine request, recorded as its responses arrive."""
    __slots__ = ("_m", "_arrival", "_last")

    def __init__(self, metrics: ModelMetrics, arrival: float) -> None:
        self._m = metrics
        self._arrival = arrival
        self._last: float | None = None

    def response(self) -> None:
        now = time.monotonic()
        if self._last is None:
            self._m.time_to_first_token.observe(now - self._arrival)
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
    """The scheduler's series, from the ModelInfo fetched for the scrape being rendered."""

    def __init__(self) -> None:
        self.model_name = ""
        self.info: pb.ModelInfo | None = None

    def collect(self) -> Iterator[Metric]:
        info, labels = self.info, [self.model_name]
        if info is None:
            return
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch.", info.num_running),
                ("num_requests_waiting", "Requests waiting to be scheduled.", info.num_waiting),
                ("kv_cache_usage_perc", "Share of KV-cache blocks in use (0 to 1).", info.kv_cache_usage)):
            yield _one(GaugeMetricFamily(f"pagedserve:{name}", doc, labels=["model_name"]), labels, value)
        for name, doc, value in (
                ("num_preemptions", "Preemptions since the scheduler started.", info.num_preemptions),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 info.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", info.prefix_cache_hits)):
            yield _one(CounterMetricFamily(f"pagedserve:{name}", doc, labels=["model_name"]), labels, value)
        config = {"block_size": info.block_size, "num_gpu_blocks": info.num_blocks,
                  "gpu_memory_utilization": round(info.gpu_memory_utilization, 4),
                  "enable_prefix_caching": info.enable_prefix_caching}
        family = GaugeMetricFamily("pagedserve:cache_config_info", "KV-cache configuration.",
                                   labels=["model_name", *config])
        yield _one(family, labels + [str(v) for v in config.values()], 1)
        for field, name, doc in STEP_HISTOGRAMS:
            # An Engine that does not time its steps leaves them out, and a histogram needs its buckets.
            if info.HasField(field):
                yield _histogram(f"pagedserve:{name}", doc, labels, getattr(info, field))


def _one(family: GaugeMetricFamily | CounterMetricFamily, labels: list[str], value: float) -> Metric:
    family.add_metric(labels, value)
    return family


def _histogram(name: str, doc: str, labels: list[str], h: pb.StepHistogram) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    bounds = [floatToGoString(b) for b in h.bucket_upper_bounds_s] + ["+Inf"]
    family.add_metric(labels, list(zip(bounds, accumulate(h.bucket_counts))), h.sum_s)
    return family


class Metrics:
    """The gateway's registry: its own series and, at scrape time, the scheduler's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        self._bound: ModelMetrics | None = None

    def bind(self, model_name: str, max_model_len: int) -> ModelMetrics:
        """The model's series, created on first use (their token buckets depend on max_model_len)."""
        if self._bound is None:
            # A gateway serves one model for its lifetime, so the first name is the only one.
            self._bound = _create(self.registry, model_name, max_model_len)
            self._engine.model_name = model_name
        return self._bound

    def render(self, info: pb.ModelInfo | None, accept: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type; `info` None leaves the scheduler's series out."""
        encoder, content_type = choose_encoder(accept)
        self._engine.info = info
        return encoder(self.registry), content_type
