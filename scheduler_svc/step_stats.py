"""Running aggregates of the step loop: the scheduler's CPU time, the executor's forward time and the
time the device sat idle between steps. Counts, sums and fixed-bucket histograms, so that a
metrics endpoint can export them as they are."""
from bisect import bisect_left
from dataclasses import dataclass, field

# Histogram bucket upper bounds in microseconds (Prometheus `le`); one more bucket holds the rest.
BUCKETS_US = (25, 50, 100, 200, 300, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000)
_BUCKETS_NS = tuple(b * 1000 for b in BUCKETS_US)


@dataclass(slots=True)
class Histogram:
    """Per-bucket (not cumulative) counts over BUCKETS_US, plus the count and sum of all values."""
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_US) + 1))
    count: int = 0
    sum_ns: int = 0

    def observe(self, ns: int) -> None:
        self.counts[bisect_left(_BUCKETS_NS, ns)] += 1
        self.count += 1
        self.sum_ns += ns

    def mean_us(self) -> float:
        return self.sum_ns / self.count / 1000 if self.count else 0.0


@dataclass(slots=True)
class StepStats:
    """One observation per applied step. `idle` leaves out steps that follow a pause for lack of
    work (the device then waited for requests, not for the control path)."""
    scheduler: Histogram = field(default_factory=Histogram)
    forward: Histogram = field(default_factory=Histogram)
    idle: Histogram = field(default_factory=Histogram)

    def observe(self, scheduler_ns: int, forward_ns: int, idle_ns: int) -> None:
        self.scheduler.observe(scheduler_ns)
        self.forward.observe(forward_ns)
        if idle_ns:
            self.idle.observe(idle_ns)

    def summary(self) -> dict:
        """Step count and mean microseconds of each part, for logs and benchmark output."""
        return dict(steps=self.scheduler.count, scheduler_us=round(self.scheduler.mean_us(), 1),
                    forward_us=round(self.forward.mean_us(), 1),
                    idle_us=round(self.idle.mean_us(), 1), idle_steps=self.idle.count)
