"""The scheduler under --scheduling-policy and with background (batch) requests: admission order,
the background share of a step, and preemption victims."""
import pytest

from pagedserve.scheduler_svc.policy import BACKGROUND_INTERVAL, background_budget, background_caps
from pagedserve.scheduler_svc.request import RequestStatus
from pagedserve.scheduler_svc.scheduler import QueueFull, Scheduler
from tests.scheduler_svc.helpers import add, make_scheduler, scheduled, step


def background_tokens(s: Scheduler, plan) -> int:
    return sum(n for seq_id, n in scheduled(plan).items() if s.requests[seq_id].background)


def test_fcfs_refuses_a_nonzero_priority_and_priority_takes_it():
    s = make_scheduler()
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        add(s, 1, 4, priority=2)
    assert not s.has_work()
    add(make_scheduler(scheduling_policy="priority"), 1, 4, priority=2)


def test_priority_admits_the_lowest_priority_first_ties_by_arrival():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    for seq_id, priority in ((1, 3), (2, 1), (3, 1), (4, -2)):
        add(s, seq_id, 4, first_token=10 * seq_id, priority=priority, max_tokens=1)
    order = []
    while s.has_work():
        plan, _ = step(s)
        order += [r.seq_id for r in plan.new_requests]
    assert order == [4, 2, 3, 1]


def test_a_background_request_is_not_admitted_while_an_interactive_one_waits():
    # 11 usable blocks of 4 tokens: the first interactive request holds 7, the second needs 6.
    s = make_scheduler(num_blocks=12, block_size=4)
    add(s, 1, 24, max_tokens=4)
    step(s)
    add(s, 2, 24, first_token=100, max_tokens=4)
    add(s, 3, 4, first_token=200, background=True, max_tokens=4)
    admitted, steps_held_back = [], 0
    while s.has_work():
        plan, _ = step(s)
        admitted += [r.seq_id for r in plan.new_requests]
        if s.requests.get(2) is not None and s.requests[2].status is RequestStatus.WAITING:
            assert s.requests[3].status is RequestStatus.WAITING
            steps_held_back += 1
    assert admitted == [2, 3] and steps_held_back >= 3


def test_a_running_background_request_makes_room_for_a_waiting_interactive_one():
    s = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=2)
    add(s, 1, 32, background=True, max_tokens=50)
    step(s)
    add(s, 2, 24, first_token=100, max_tokens=4)
    plan, _ = step(s)
    assert [r.seq_id for r in plan.new_requests] == [2] and plan.dropped == [1]
    assert s.requests[1].status is RequestStatus.WAITING and s.num_preemptions == 1


def test_beside_interactive_decodes_a_background_prompt_runs_in_chunks_and_skips_interactive_prefill_steps():
    s = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    for seq_id in (1, 2):
        add(s, seq_id, 4, first_token=10 * seq_id, max_tokens=60)
    step(s)
    add(s, 3, 200, first_token=100, background=True, max_tokens=30)
    budget, max_chunk, _ = background_budget(64 - 2, 2, 8, True, s.background_caps)
    plan, _ = step(s)
    # A decode step: the background prompt joins it, one allowance's chunk at a time.
    assert scheduled(plan) == {1: 1, 2: 1, 3: min(budget, max_chunk)}
    add(s, 4, 10, first_token=400, max_tokens=60)
    plan, _ = step(s)
    # The interactive prompt makes this step a prefill step: background work waits it out.
    assert scheduled(plan) == {1: 1, 2: 1, 4: 10}
    plan, _ = step(s)
    budget, max_chunk, _ = background_budget(64 - 3, 3, 8, True, s.background_caps)
    assert scheduled(plan) == {1: 1, 2: 1, 4: 1, 3: min(budget, max_chunk)}
    # Once no interactive request is left, background ones fill the step.
    for rid in ("r1", "r2", "r4"):
        s.abort(rid)
    plan, _ = step(s)
    assert background_tokens(s, plan) == plan.num_tokens == 64


def test_while_every_step_prefills_an_interactive_prompt_background_work_runs_after_the_interval():
    s = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    add(s, 2, 8, first_token=100, background=True, max_tokens=4)
    waited = 0
    while s.requests[2].status is RequestStatus.WAITING:
        add(s, 1000 + waited, 2, max_tokens=2)
        step(s)
        waited += 1
    assert waited == BACKGROUND_INTERVAL + 1


def test_background_decode_rows_beside_interactive_ones_stay_within_the_allowance_the_rest_wait_running():
    s = make_scheduler(num_blocks=512, max_num_seqs=128, max_num_batched_tokens=128)
    for seq_id in range(1, 121):
        add(s, seq_id, 1, first_token=seq_id, background=True, max_tokens=50)
    step(s)
    add(s, 900, 2, first_token=900, max_tokens=50)
    plan, _ = step(s)
    # The interactive prompt's step takes no background work.
    assert scheduled(plan) == {900: 2}
    plan, _ = step(s)
    budget, _, _ = background_budget(128 - 1, 1, 128, True, s.background_caps)
    assert 0 < budget < 120
    assert scheduled(plan)[900] == 1 and background_tokens(s, plan) == budget
    assert all(n == 1 for n in scheduled(plan).values())
    # Those left out keep their blocks (no prompt to recompute); the next step serves the same ones.
    assert not s.waiting_background and len(s.running) == 121
    assert set(scheduled(step(s)[0])) == set(scheduled(plan))


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float8_e4m3fn"])
def test_beside_interactive_load_background_admission_stops_at_the_allowance_of_rows(kv_cache_dtype):
    s = make_scheduler(num_blocks=512, max_num_seqs=64, max_num_batched_tokens=256, kv_cache_dtype=kv_cache_dtype)
    add(s, 1, 2, max_tokens=200)
    step(s)
    for seq_id in range(2, 100):
        add(s, seq_id, 4, first_token=10 * seq_id, background=True, max_tokens=200)
    for _ in range(40):
        step(s)
    _, _, max_rows = background_budget(256 - 1, 1, 64, True, background_caps(kv_cache_dtype))
    assert len(s.running) - 1 == max_rows and s.waiting_background


def test_with_no_interactive_load_background_requests_use_the_whole_budget_as_interactive_ones_would():
    plans = []
    for background in (False, True):
        s = make_scheduler(max_num_batched_tokens=64)
        for seq_id in (1, 2, 3):
            add(s, seq_id, 40, first_token=50 * seq_id, background=background)
        plans.append([scheduled(step(s)[0]) for _ in range(4)])
    assert plans[0] == plans[1]
    assert sum(plans[1][0].values()) == 64


def test_kv_pressure_preempts_background_requests_first_even_if_admitted_earlier():
    s = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64)
    add(s, 1, 12, background=True, max_tokens=100)
    step(s)
    add(s, 2, 12, first_token=100, max_tokens=100)
    preempted = []
    while not preempted:
        plan, _ = step(s)
        preempted = plan.dropped
    assert preempted == [1] and s.requests[2].status is RequestStatus.RUNNING


def test_under_priority_kv_pressure_preempts_the_least_urgent_interactive_request():
    s = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64, scheduling_policy="priority")
    add(s, 1, 12, priority=5, max_tokens=100)
    add(s, 2, 12, first_token=100, priority=0, max_tokens=100)
    preempted = []
    while not preempted:
        plan, _ = step(s)
        preempted = plan.dropped
    assert preempted == [1] and s.requests[2].status is RequestStatus.RUNNING


def test_queued_background_requests_never_fill_the_queue_for_interactive_ones():
    # One free running slot and two queued: three requests of each class may wait.
    s = make_scheduler(max_num_seqs=1, max_num_queued_reqs=2)
    for seq_id in (1, 2, 3):
        add(s, seq_id, 4, background=True)
    with pytest.raises(QueueFull):
        add(s, 4, 4, background=True)
    for seq_id in (4, 5, 6):
        add(s, seq_id, 4)
    with pytest.raises(QueueFull):
        add(s, 7, 4)
    with pytest.raises(QueueFull):
        add(s, 7, 4, background=True)
