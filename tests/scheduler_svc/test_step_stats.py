from pagedserve.common.plan import StepResult
from pagedserve.scheduler_svc.step_stats import BUCKETS_US, Histogram
from tests.scheduler_svc.helpers import add, make_scheduler


def test_histogram_buckets_are_upper_bounds():
    h = Histogram()
    for us in (0, 25, 25.001, 300, 100_000, 100_001, 10**7):
        h.observe(int(us * 1000))
    assert len(h.counts) == len(BUCKETS_US) + 1
    assert h.counts[0] == 2 and h.counts[1] == 1 and h.counts[BUCKETS_US.index(300)] == 1
    assert h.counts[-2] == 1 and h.counts[-1] == 2
    assert h.count == 7 and h.sum_ns == sum(int(us * 1000) for us in (0, 25, 25.001, 300, 100_000, 100_001, 10**7))


def run_step(s, forward_ns: int, idle_ns: int) -> None:
    plan = s.schedule()
    seq_ids = [r.seq_id for r in plan.new_requests + plan.continuing]
    s.update(plan, StepResult(plan.step_id, seq_ids, [7] * len(seq_ids), forward_ns, idle_ns))


def test_steps_are_counted_and_idle_only_between_back_to_back_steps():
    s = make_scheduler()
    add(s, 1, 3, max_tokens=2)
    run_step(s, forward_ns=5_000, idle_ns=900_000)  # follows a pause: not the control path's cost
    run_step(s, forward_ns=7_000, idle_ns=40_000)
    run_step(s, forward_ns=0, idle_ns=20_000)  # sends the finished request's drop
    assert not s.has_work()
    add(s, 2, 3, max_tokens=1)
    run_step(s, forward_ns=3_000, idle_ns=800_000)
    stats = s.stats
    assert stats.scheduler.count == stats.forward.count == 4
    assert stats.forward.sum_ns == 15_000
    assert (stats.idle.count, stats.idle.sum_ns) == (2, 60_000)
    assert stats.scheduler.sum_ns > 0
    assert stats.summary()["steps"] == 4 and stats.summary()["idle_us"] == 30.0

