from collections import deque

import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler_svc.policy import (BACKGROUND_INTERVAL, BACKGROUND_PREFILL_TOKENS,
                                             BACKGROUND_PREFILL_TOKENS_FP8, BACKGROUND_ROWS, BACKGROUND_ROWS_FP8,
                                             BACKLOG_STEPS, BURST_TOKENS, FCFS, PRIORITY, STEP_TOKENS, admit,
                                             background_budget, background_caps, background_turn, check_priority,
                                             enqueue, num_interactive, prompt_budget, requeue)
from pagedserve.scheduler_svc.request import Request


def request(seq_id: int, priority: int = 0, background: bool = False) -> Request:
    """seq_id doubles as the order of arrival."""
    r = Request(seq_id, f"r{seq_id}", [1, 2], SamplingParams(), priority=priority, background=background,
                arrival=seq_id)
    r.max_num_tokens = 100
    return r


def ids(requests) -> list[int]:
    return [r.seq_id for r in requests]


def test_fcfs_queues_by_arrival_and_puts_a_preempted_request_first():
    waiting = deque()
    for r in (request(1, 5), request(2, -3), request(3)):
        enqueue(waiting, r, FCFS)
    requeue(waiting, request(0, 9), FCFS)
    assert ids(waiting) == [0, 1, 2, 3]


def test_priority_queues_by_priority_then_arrival_preempted_requests_included():
    waiting = deque()
    for r in (request(1, 5), request(2, -3), request(3), request(4, -3), request(5, 5)):
        enqueue(waiting, r, PRIORITY)
    assert ids(waiting) == [2, 4, 3, 1, 5]
    # A preempted request goes back by its key: ahead of later arrivals of its priority, behind
    # more urgent ones.
    requeue(waiting, request(0, 0), PRIORITY)
    assert ids(waiting) == [2, 4, 0, 3, 1, 5]


def test_running_keeps_interactive_requests_first_so_the_last_is_the_preemption_victim():
    running = []
    for r in (request(1, background=True), request(2), request(3, background=True), request(4)):
        admit(running, r, FCFS)
    assert ids(running) == [2, 4, 1, 3] and num_interactive(running) == 2
    # The most recently admitted background request goes first, then the last interactive one.
    assert running[-1].seq_id == 3


def test_under_priority_the_interactive_victim_has_the_largest_priority_and_arrival():
    running = []
    for r in (request(1, 5), request(2, background=True), request(3, 0), request(4, 5), request(5, -1)):
        admit(running, r, PRIORITY)
    assert ids(running) == [5, 3, 1, 4, 2]
    running.pop()
    assert running[-1].seq_id == 4


def test_background_budget_is_everything_left_without_interactive_load_else_a_shrinking_allowance():
    caps = (BACKGROUND_ROWS, BACKGROUND_PREFILL_TOKENS)
    assert background_budget(500, 0, 256, False, caps) == background_budget(500, 0, 256, True, caps) == (500, 500, 256)
    # Beside interactive requests, in its turn: decode rows and a prompt chunk.
    rows, prefill = BACKGROUND_ROWS // 2, BACKGROUND_PREFILL_TOKENS // 2
    assert background_budget(500, 128, 256, True, caps) == (rows + prefill, prefill, rows)
    # Out of its turn (a step that prefills an interactive prompt): nothing.
    assert background_budget(500, 128, 256, False, caps) == (0, 0, 0)
    assert background_budget(10, 1, 256, True, caps)[:2] == (10, 10)
    assert background_budget(500, 256, 256, True, caps) == background_budget(500, 300, 256, True, caps) == (0, 0, 0)
    allowances = [background_budget(8192, n, 256, True, caps) for n in range(1, 300)]
    assert allowances == sorted(allowances, reverse=True)


def test_an_8_bit_kv_cache_gives_background_work_more_rows_and_prompt_tokens():
    assert background_caps("bfloat16") == background_caps("float32") == background_caps("") == (
        BACKGROUND_ROWS, BACKGROUND_PREFILL_TOKENS)
    assert background_caps("float8_e4m3fn") == (BACKGROUND_ROWS_FP8, BACKGROUND_PREFILL_TOKENS_FP8)
    assert BACKGROUND_ROWS_FP8 > BACKGROUND_ROWS and BACKGROUND_PREFILL_TOKENS_FP8 > BACKGROUND_PREFILL_TOKENS
    # 10 interactive requests of 256 leave 96% of each cap, rounded down: 19 rows and 38 tokens, or 28 and 57.
    assert background_budget(500, 10, 256, True, background_caps("bfloat16")) == (57, 38, 19)
    assert background_budget(500, 10, 256, True, background_caps("float8_e4m3fn")) == (85, 57, 28)


def test_background_work_skips_steps_that_prefill_interactive_prompts_until_the_interval():
    assert background_turn(False, 5) == (True, 0)
    assert background_turn(True, 0) == (False, 1)
    assert background_turn(True, BACKGROUND_INTERVAL - 1) == (False, BACKGROUND_INTERVAL)
    assert background_turn(True, BACKGROUND_INTERVAL) == (True, 0)


def prompts(*lengths: int) -> list[Request]:
    return [Request(i, f"r{i}", list(range(1, n + 1)), SamplingParams()) for i, n in enumerate(lengths)]


def test_prompts_fill_decode_steps_to_step_tokens_only_where_mixed_steps_replay_as_graphs():
    waiting = prompts(300, 200)
    # Mixed steps run eagerly (a CPU, --enforce-eager): every step may take its whole budget.
    assert prompt_budget(10, waiting, 8192, 0) == 8192
    # Nothing decodes: BURST_TOKENS, so that the first of many prompts answer early, but a long
    # first prompt whole (up to the step's budget), since cutting it would gain no one anything.
    assert prompt_budget(0, waiting, 8192, 512) == BURST_TOKENS
    assert prompt_budget(0, prompts(BURST_TOKENS + 500, 200), 8192, 512) == BURST_TOKENS + 500
    assert prompt_budget(0, prompts(9000), 8192, 512) == 8192
    assert prompt_budget(0, waiting, BURST_TOKENS // 2, 512) == BURST_TOKENS // 2
    assert prompt_budget(10, waiting, 8192, 512) == STEP_TOKENS - 10
    # Smaller graphs bound the step.
    assert prompt_budget(10, prompts(50), 8192, STEP_TOKENS // 2) == STEP_TOKENS // 2 - 10
    # Rows near STEP_TOKENS make the step compute-bound anyway: prompts take the whole budget.
    assert prompt_budget(STEP_TOKENS // 2, waiting, 8192, 512) == prompt_budget(300, waiting, 8192, 512) == 8192
    budgets = [prompt_budget(n, waiting, 8192, 512) for n in range(1, STEP_TOKENS // 2)]
    assert budgets == sorted(budgets, reverse=True)
    assert min(budgets) > STEP_TOKENS // 2


def test_a_backlog_of_prompts_larger_than_backlog_steps_chunks_gets_burst_tokens_steps():
    chunk = STEP_TOKENS - 10
    assert prompt_budget(10, prompts(BACKLOG_STEPS * chunk - 100, 100), 8192, 512) == chunk
    assert prompt_budget(10, prompts(BACKLOG_STEPS * chunk - 100, 101), 8192, 512) == BURST_TOKENS
    assert prompt_budget(10, prompts(BACKLOG_STEPS * chunk - 100, 101), 1024, 512) == 1024


def test_a_nonzero_priority_is_refused_only_under_fcfs():
    with pytest.raises(ValueError, match="^priority 3 needs --scheduling-policy priority"):
        check_priority(3, FCFS)
    check_priority(0, FCFS)
    check_priority(-7, PRIORITY)
