"""vLLM's periodic engine line: every interval while the engine is busy, prompt and generation
throughput, running and waiting requests, KV-cache usage and prefix-cache hit rate."""
import asyncio
import os
import time
from dataclasses import dataclass

from pagedserve.common.log import get_logger
from pagedserve.scheduler_svc.engine_loop import EngineLoop
from pagedserve.scheduler_svc.scheduler import Scheduler

log = get_logger(__name__)
# As vLLM's VLLM_LOG_STATS_INTERVAL.
DEFAULT_INTERVAL_S = 10.0


def interval_from_env() -> float:
    return float(os.environ.get("PAGEDSERVE_LOG_STATS_INTERVAL", DEFAULT_INTERVAL_S))


@dataclass(slots=True)
class Totals:
    at: float
    prompt_tokens: int
    generation_tokens: int
    cache_queries: int
    cache_hits: int

    @classmethod
    def of(cls, s: Scheduler) -> "Totals":
        return cls(time.monotonic(), s.num_prompt_tokens, s.num_generation_tokens,
                   s.prefix_cache_queries, s.prefix_cache_hits)


class StatsLogger:
    def __init__(self, loop: EngineLoop, interval_s: float) -> None:
        self.loop = loop
        self.scheduler = loop.scheduler
        self.interval_s = interval_s
        self.last = Totals.of(self.scheduler)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.log()

    def log(self) -> None:
        """Logs the line for the time since the last call, unless the engine was idle all along."""
        if self.loop.scheduler is not self.scheduler:
            # A reattached executor comes with a fresh scheduler, whose counters start at 0.
            self.scheduler, self.last = self.loop.scheduler, Totals.of(self.loop.scheduler)
        s, last = self.scheduler, self.last
        now = self.last = Totals.of(s)
        prompt, generation = now.prompt_tokens - last.prompt_tokens, now.generation_tokens - last.generation_tokens
        if not (prompt or generation or s.num_running or s.num_waiting):
            return
        seconds = max(now.at - last.at, 1e-9)
        queries = now.cache_queries - last.cache_queries
        hits = now.cache_hits - last.cache_hits
        log.info("engine_stats", prompt_tokens_per_s=round(prompt / seconds, 1),
                 generation_tokens_per_s=round(generation / seconds, 1), running=s.num_running,
                 waiting=s.num_waiting, kv_cache_usage_pct=round(100 * s.kv_usage, 1),
                 prefix_cache_hit_rate_pct=round(100 * hits / queries, 1) if queries else 0.0)
