import pytest

from pagedserve.common.plan import INVALID_ARGUMENT, RequestError, StepLogprobs, StepResult
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler_svc import policy
from pagedserve.scheduler_svc.policy import BACKLOG_STEPS
from pagedserve.scheduler_svc.request import Request, RequestDelta, RequestStatus, TokenLogprobs
from pagedserve.scheduler_svc.scheduler import QueueFull, Scheduler
from tests.scheduler_svc.helpers import EOS, add, make_scheduler, scheduled, step


def test_token_budget_is_respected():
    s = make_scheduler(max_num_batched_tokens=10)
    for seq_id in range(1, 5):
        add(s, seq_id, 6, first_token=10 * seq_id)
    plan, _ = step(s)
    assert scheduled(plan) == {1: 6, 2: 4}
    for _ in range(20):
        plan, _ = step(s)
        assert 0 < plan.num_tokens <= 10


def test_requests_past_the_queue_limit_are_refused():
    s = make_scheduler(max_num_seqs=2, max_num_queued_reqs=1)
    # Two go straight to free running slots, one queues, the next is refused.
    for seq_id in range(1, 4):
        add(s, seq_id, 3, max_tokens=50)
    with pytest.raises(QueueFull, match="--max-num-queued-reqs"):
        add(s, 4, 3)
    step(s)
    assert (s.num_running, s.num_waiting) == (2, 1)
    with pytest.raises(QueueFull):
        add(s, 4, 3)
    s.abort("r3")
    add(s, 4, 3)
    s.abort("r1")
    # A running slot came free: the queued request takes it at the next step, so one more may wait.
    add(s, 5, 3)
    assert s.num_waiting == 2
    with pytest.raises(QueueFull):
        add(s, 6, 3)


def test_max_num_seqs_is_respected():
    s = make_scheduler(max_num_seqs=2)
    for seq_id in range(1, 5):
        add(s, seq_id, 3, max_tokens=2)
    plan, _ = step(s)
    assert scheduled(plan) == {1: 3, 2: 3}
    plan, outputs = step(s)
    assert scheduled(plan) == {1: 1, 2: 1}
    assert [o.finished for o in outputs] == [True, True]
    plan, _ = step(s)
    assert scheduled(plan) == {3: 3, 4: 3} and plan.dropped == [1, 2]


def test_chunked_prefill_splits_a_long_prompt():
    s = make_scheduler(max_num_batched_tokens=10, block_size=4)
    add(s, 1, 25)
    chunks, blocks = [], []
    for _ in range(3):
        plan, outputs = step(s)
        chunks.append(plan.num_tokens)
        blocks += plan.new_requests[0].block_ids if plan.new_requests else plan.continuing[0].new_block_ids
        assert len(blocks) == -(-sum(chunks) // 4)
        assert bool(outputs) == (sum(chunks) == 25)
    assert chunks == [10, 10, 5]
    assert s.requests[1].output_token_ids == [7]


def test_long_prefill_token_threshold_caps_each_prompts_tokens_a_step_so_prompts_share_steps():
    s = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=12)
    add(s, 1, 30)
    add(s, 2, 20, first_token=100)
    add(s, 3, 5, first_token=200)
    plan, _ = step(s)
    assert scheduled(plan) == {1: 12, 2: 12, 3: 5}
    plan, _ = step(s)
    # Request 3 decodes; 1 and 2 go on in chunks of at most 12.
    assert scheduled(plan) == {1: 12, 2: 8, 3: 1}
    plan, _ = step(s)
    assert scheduled(plan) == {1: 6, 2: 1, 3: 1}


def test_beside_decode_rows_prompts_fill_each_step_to_the_mixed_graph_size_and_no_row_waits():
    # Mixed steps of up to 16 tokens replay as graphs here (scheduler_svc/policy.py, STEP_TOKENS).
    s = make_scheduler(max_num_batched_tokens=64, mixed_graph_tokens=16, max_num_seqs=8)
    add(s, 1, 30, max_tokens=50)
    # Nothing decodes: the whole prompt in one step.
    assert scheduled(step(s)[0]) == {1: 30}
    add(s, 2, 25, first_token=100, max_tokens=50)
    add(s, 3, 10, first_token=200, max_tokens=50)
    plans = [step(s)[0] for _ in range(4)]
    assert [scheduled(plan) for plan in plans] == [{1: 1, 2: 15}, {1: 1, 2: 10, 3: 4}, {1: 1, 2: 1, 3: 6},
                                                   {1: 1, 2: 1, 3: 1}]
    assert all(plan.num_tokens <= 16 for plan in plans)


def test_a_burst_of_prompts_beside_decode_rows_gets_burst_steps_until_the_backlog_is_small():
    # BURST_TOKENS is past this budget of 64: the burst's steps take all of it.
    s = make_scheduler(num_blocks=400, max_num_batched_tokens=64, mixed_graph_tokens=32, max_num_seqs=16)
    add(s, 1, 4, max_tokens=50)
    step(s)
    for seq_id in range(2, 17):
        add(s, seq_id, 20, first_token=50 * seq_id, max_tokens=50)
    kinds = []
    while s.waiting:
        backlog = sum(len(r.token_ids) for r in s.waiting)
        whole = backlog > BACKLOG_STEPS * (32 - s.num_running)
        plan, _ = step(s)
        kinds.append(whole)
        assert plan.num_tokens == 64 if whole else plan.num_tokens <= 32
    # Burst steps while 8 chunks would not take in the backlog, chunks after.
    assert kinds[0] and not kinds[-1] and kinds == sorted(kinds, reverse=True)


def test_a_burst_with_nothing_running_answers_its_first_prompts_after_a_step_of_burst_tokens(monkeypatch):
    monkeypatch.setattr(policy, "BURST_TOKENS", 40)
    s = make_scheduler(num_blocks=400, max_num_batched_tokens=64, mixed_graph_tokens=32, max_num_seqs=16)
    for seq_id in range(1, 7):
        add(s, seq_id, 15, first_token=50 * seq_id, max_tokens=50)
    plan, outputs = step(s)
    assert scheduled(plan) == {1: 15, 2: 15, 3: 10}
    assert [o.seq_id for o in outputs] == [1, 2]
    # A lone prompt longer than BURST_TOKENS goes whole: cutting it would speed no one up.
    s = make_scheduler(num_blocks=400, max_num_batched_tokens=64, mixed_graph_tokens=32, max_num_seqs=16)
    add(s, 1, 60, max_tokens=50)
    assert scheduled(step(s)[0]) == {1: 60}


def test_offline_prompts_fill_every_step_budget_where_online_ones_go_in_chunks_beside_decodes():
    def token_counts(offline: bool) -> list[int]:
        s = make_scheduler(num_blocks=400, max_num_batched_tokens=64, mixed_graph_tokens=32,
                           max_num_seqs=16, offline=offline)
        for seq_id in range(1, 13):
            add(s, seq_id, 20, first_token=50 * seq_id, max_tokens=50)
        return [sum(scheduled(step(s)[0]).values()) for _ in range(7)]

    # 240 prompt tokens: the whole budget of 64 a step until they are in, then 12 decode rows.
    assert token_counts(offline=True) == [64, 64, 64, 64, 13, 12, 12]
    # Online, steps beside decode rows stop at the mixed graphs' 32 tokens (scheduler_svc/policy.py).
    online = token_counts(offline=False)
    assert online[0] == 64 and max(online[1:]) <= 32 and min(online[1:]) > 12


def test_running_requests_are_scheduled_before_waiting_ones():
    s = make_scheduler(max_num_batched_tokens=8)
    add(s, 1, 5)
    step(s)
    add(s, 2, 20)
    plan, _ = step(s)
    assert [r.seq_id for r in plan.continuing] == [1] and plan.continuing[0].num_scheduled_tokens == 1
    assert [(r.seq_id, r.num_scheduled_tokens) for r in plan.new_requests] == [(2, 7)]


def test_waiting_head_that_does_not_fit_blocks_the_queue():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    add(s, 1, 12)
    add(s, 2, 12, first_token=50)
    add(s, 3, 2, first_token=90)
    plan, _ = step(s)
    assert scheduled(plan) == {1: 12}
    assert [r.seq_id for r in s.waiting] == [2, 3]


def test_preemption_evicts_the_newest_and_resends_it_with_its_outputs():
    s = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=2, enable_prefix_caching=False)
    a = add(s, 1, 4)
    b = add(s, 2, 4, first_token=50)
    c = add(s, 3, 1, first_token=90)
    for _ in range(5):
        step(s)
    assert s.num_free_blocks == 0 and s.num_preemptions == 0
    assert len(a.token_ids) == len(b.token_ids) == 9
    plan, _ = step(s)
    # a needs a third block for position 8; b, the newest, gives up its two.
    assert s.num_preemptions == 1
    assert scheduled(plan) == {1: 1} and plan.dropped == [2] and not plan.new_requests
    assert list(s.waiting) == [b, c]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    known = list(b.token_ids)
    assert known == b.prompt_token_ids + b.output_token_ids and len(known) == 9
    s.abort(1)
    plan, _ = step(s)
    assert plan.dropped == [1]
    resent = plan.new_requests[0]
    assert (resent.seq_id, resent.token_ids, resent.num_computed_tokens, resent.num_scheduled_tokens) == (
        2, known, 0, 9)
    # The executor tells prompt from earlier outputs (for penalties and min_tokens) by this.
    assert resent.num_prompt_tokens == 4
    assert len(resent.block_ids) == 3 and b.output_token_ids == known[4:] + [7]


def test_preempted_request_revives_its_surviving_blocks_from_the_prefix_cache():
    s = make_scheduler(num_blocks=5, block_size=4)
    add(s, 1, 4)
    b = add(s, 2, 4, first_token=50)
    for _ in range(6):
        step(s)
    assert s.num_preemptions == 1
    s.abort(1)
    plan, _ = step(s)
    # b freed its tail first, so a took the tail block; b's first block is still cached.
    resent = plan.new_requests[0]
    assert resent.seq_id == 2 and resent.num_computed_tokens == 4
    assert b.num_cached_tokens == 0 and s.prefix_cache_hits == 4


def test_newest_request_preempts_itself_when_the_pool_is_full():
    s = make_scheduler(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = add(s, 1, 3)
    b = add(s, 2, 2, first_token=50)
    plan, _ = step(s)
    assert scheduled(plan) == {1: 3, 2: 2} and s.num_free_blocks == 0
    plan, _ = step(s)
    assert scheduled(plan) == {1: 1} and plan.dropped == [2]
    assert a.status is RequestStatus.RUNNING and list(s.waiting) == [b]


def test_nothing_is_admitted_in_a_step_that_preempted():
    s = make_scheduler(num_blocks=5, block_size=2, max_num_batched_tokens=3, enable_prefix_caching=False)
    add(s, 1, 2)
    add(s, 2, 2, first_token=50)
    for _ in range(3):
        step(s)
    plan, _ = step(s)
    # b's first chunk would fit in the blocks it just released, but it waits a step.
    assert scheduled(plan) == {1: 1} and plan.dropped == [2]
    plan, _ = step(s)
    assert scheduled(plan) == {1: 1, 2: 2} and plan.new_requests[0].seq_id == 2


def test_request_longer_than_the_pool_finishes_with_length():
    s = make_scheduler(num_blocks=3, block_size=4, max_model_len=100)
    assert s.max_len == 9
    request = add(s, 1, 6, max_tokens=None)
    outputs = []
    for _ in range(4):
        outputs += step(s)[1]
    assert not s.has_work()
    assert request.output_token_ids == [7, 7, 7]
    assert outputs[-1].finish_reason == "length" and s.num_free_blocks == 2


@pytest.mark.parametrize("prompt_len, message", [
    (32, "maximum context length is 32 tokens, but the prompt has 32 tokens; shorten it to at most 31"),
    (40, "maximum context length is 32 tokens, but the prompt has 40 tokens"),
    (0, "the prompt is empty"),
])
def test_prompt_that_cannot_fit_the_context_is_rejected(prompt_len, message):
    s = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match=message):
        add(s, 1, prompt_len)
    assert not s.has_work()


def test_prompt_larger_than_the_kv_cache_is_rejected():
    s = make_scheduler(num_blocks=3, block_size=4, max_model_len=100)
    add(s, 1, 8)
    with pytest.raises(ValueError, match="KV cache holds 8 tokens, but the prompt has 9 tokens"):
        add(s, 2, 9)


def test_config_that_cannot_schedule_is_rejected():
    with pytest.raises(ValueError, match="must be at least 1"):
        make_scheduler(max_num_batched_tokens=0)


def test_duplicate_ids_are_rejected():
    s = make_scheduler()
    add(s, 1, 3)
    with pytest.raises(ValueError, match="already queued"):
        add(s, 1, 3)


def run_to_end(s: Scheduler, tokens: list[int]) -> list[RequestDelta]:
    outputs = []
    for token in tokens:
        outputs += step(s, {1: token})[1]
    return outputs


def test_eos_stops_with_its_token():
    s = make_scheduler()
    add(s, 1, 3)
    outputs = run_to_end(s, [5, EOS])
    assert [(o.new_token_ids, o.finished, o.finish_reason, o.stop_token_id) for o in outputs] == [
        ([5], False, None, None), ([EOS], True, "stop", EOS)]
    assert outputs[-1].num_prompt_tokens == 3 and outputs[-1].num_output_tokens == 2
    plan, _ = step(s)
    assert plan.dropped == [1] and s.num_free_blocks == 63 and not s.has_work()


def test_stop_token_ids_stop_even_with_ignore_eos():
    s = make_scheduler()
    add(s, 1, 3, stop_token_ids=[9], ignore_eos=True)
    outputs = run_to_end(s, [EOS, 5, 9])
    assert [o.finish_reason for o in outputs] == [None, None, "stop"] and outputs[-1].stop_token_id == 9


def test_min_tokens_holds_back_stops():
    s = make_scheduler()
    add(s, 1, 3, min_tokens=2, stop_token_ids=[9])
    outputs = run_to_end(s, [EOS, 9])
    assert [o.finish_reason for o in outputs] == [None, "stop"]


def test_new_requests_carry_their_sampling_params_and_the_ids_to_mask_until_min_tokens():
    s = make_scheduler()
    first = add(s, 1, 3, min_tokens=2, stop_token_ids=[9, 4], presence_penalty=0.5, frequency_penalty=-1.0,
                repetition_penalty=1.2, logprobs=3)
    add(s, 2, 3, stop_token_ids=[9])
    add(s, 3, 3, min_tokens=1, ignore_eos=True, stop_token_ids=[9])
    plan = s.schedule()
    new = {r.seq_id: r for r in plan.new_requests}
    assert new[1].sampling == first.sampling and new[1].sampling.stop_token_ids == [9, 4]
    assert new[1].min_tokens_mask_ids == [EOS, 4, 9]
    # Without min_tokens nothing is masked, so the stops need not travel.
    assert new[2].min_tokens_mask_ids == [] and new[2].sampling.stop_token_ids == [9]
    assert new[3].min_tokens_mask_ids == [9]
    assert {r.num_prompt_tokens for r in plan.new_requests} == {3}


def test_logprobs_reach_the_outputs_of_the_rows_that_carry_them():
    s = make_scheduler()
    for seq_id in (1, 2, 3):
        add(s, seq_id, 3)
    plan = s.schedule()
    s.abort(1)
    logprobs = StepLogprobs(rows=[0, 2], logprobs=[-0.5, -2.0], ranks=[1, 4], num_top=[2, 1],
                            top_token_ids=[7, 8, 6], top_logprobs=[-0.5, -1.0, -0.1])
    outputs = s.update(plan, StepResult(plan.step_id, [1, 2, 3], [7, 7, 9], logprobs=logprobs))
    assert [o.seq_id for o in outputs] == [2, 3]
    assert outputs[0].logprobs is None
    assert outputs[1].logprobs == [TokenLogprobs(-2.0, 4, [6], [-0.1])]


def test_max_tokens_finishes_with_length():
    s = make_scheduler()
    add(s, 1, 3, max_tokens=2)
    outputs = run_to_end(s, [5, 6])
    assert [o.finish_reason for o in outputs] == [None, "length"] and outputs[-1].stop_token_id is None


def test_max_model_len_finishes_with_length():
    s = make_scheduler(max_model_len=5)
    add(s, 1, 3, max_tokens=None)
    outputs = run_to_end(s, [5, 6])
    assert [o.finish_reason for o in outputs] == [None, "length"]


def test_stop_token_wins_over_length():
    s = make_scheduler()
    add(s, 1, 3, max_tokens=1)
    assert run_to_end(s, [EOS])[0].finish_reason == "stop"


def test_abort_frees_blocks_and_drops_the_seq():
    s = make_scheduler()
    add(s, 1, 9)
    add(s, 2, 3)
    step(s)
    free = s.num_free_blocks
    assert s.abort("r1")
    assert s.num_free_blocks == free + 3 and s.num_running == 1
    assert not s.abort("r1") and not s.abort(1)
    plan, _ = step(s)
    assert plan.dropped == [1] and list(scheduled(plan)) == [2]


def test_abort_of_a_waiting_request_sends_no_drop():
    s = make_scheduler(max_num_seqs=1)
    add(s, 1, 3)
    add(s, 2, 3)
    step(s)
    assert s.abort(2) and s.num_waiting == 0
    plan, _ = step(s)
    assert plan.dropped == []


def test_token_of_a_request_aborted_in_flight_is_ignored():
    s = make_scheduler()
    add(s, 1, 3)
    plan = s.schedule()
    s.abort(1)
    assert s.update(plan, StepResult(plan.step_id, [1], [5])) == []
    assert s.schedule().dropped == [1]


def test_a_request_the_executor_fails_ends_alone():
    s = make_scheduler()
    add(s, 1, 3)
    add(s, 2, 3)
    plan = s.schedule()
    result = StepResult(plan.step_id, [1, 2], [7, 7], errors=[RequestError(2, INVALID_ARGUMENT, "bad grammar")])
    outputs = {o.seq_id: o for o in s.update(plan, result)}
    assert outputs[2].finished and outputs[2].finish_reason == "error" and outputs[2].new_token_ids == []
    assert (outputs[2].error_code, outputs[2].error) == (INVALID_ARGUMENT, "bad grammar")
    assert outputs[1].new_token_ids == [7] and not outputs[1].finished
    plan, outputs = step(s)
    assert plan.dropped == [2] and scheduled(plan) == {1: 1} and outputs[0].seq_id == 1


def test_a_deferred_token_is_void_and_its_position_planned_again():
    """The executor could not sample seq 2 yet (its grammar compiles) and rolled it back one token."""
    s = make_scheduler()
    add(s, 1, 3)
    add(s, 2, 3)
    first = s.schedule()
    # Planned before the first result: both decode the token the first step samples.
    second = s.schedule()
    outputs = s.update(first, StepResult(first.step_id, [1, 2], [7, 8], deferred=[2]))
    assert [(o.seq_id, o.new_token_ids) for o in outputs] == [(1, [7])]
    assert s.requests[2].num_computed_tokens == 3 and s.requests[2].token_ids == [1, 2, 3]
    # The second step computed seq 2's last prompt position again and sampled it.
    outputs = s.update(second, StepResult(second.step_id, [1, 2], [7, 9]))
    assert [(o.seq_id, o.new_token_ids) for o in outputs] == [(1, [7]), (2, [9])]
    plan, _ = step(s)
    assert scheduled(plan) == {1: 1, 2: 1} and s.requests[2].num_computed_tokens == 4


def test_mismatched_result_is_refused():
    s = make_scheduler()
    add(s, 1, 3)
    plan = s.schedule()
    with pytest.raises(ValueError, match="does not match"):
        s.update(plan, StepResult(plan.step_id + 1))


def test_prefix_cache_hit_is_reported_and_counted():
    s = make_scheduler(block_size=4)
    add(s, 1, 10, max_tokens=1)
    step(s)
    add(s, 2, 11)
    plan, outputs = step(s)
    assert plan.new_requests[0].num_computed_tokens == 8
    assert outputs[0].num_cached_tokens == 8
    assert s.prefix_cache_queries == 21 and s.prefix_cache_hits == 8


def test_requests_with_another_cache_salt_get_no_prefix_hit():
    s = make_scheduler(block_size=4)
    prompt = list(range(1, 11))
    s.add(Request(1, "a", prompt, SamplingParams(max_tokens=1), cache_salt="tenant-a"))
    step(s)
    hits = []
    for seq_id, salt in ((2, "tenant-b"), (3, ""), (4, "tenant-a")):
        s.add(Request(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=1), cache_salt=salt))
        _, outputs = step(s)
        hits.append(outputs[0].num_cached_tokens)
    assert hits == [0, 0, 8]
    with pytest.raises(ValueError, match="cache_salt holds 257 characters"):
        s.add(Request(5, "r5", prompt, SamplingParams(), cache_salt="x" * 257))


def test_output_tokens_become_cacheable_once_computed():
    s = make_scheduler(block_size=4)
    add(s, 1, 6, max_tokens=4)
    for _ in range(4):
        step(s)
    # prompt 1..6 then outputs 7, 7, 7, 7: the first 9 tokens were computed, so two blocks are cached.
    request = Request(2, "r2", list(range(1, 7)) + [7, 7, 7, 7], SamplingParams())
    s.add(request)
    plan, _ = step(s)
    assert plan.new_requests[0].num_computed_tokens == 8


def test_stats_follow_the_pool():
    s = make_scheduler(num_blocks=11, block_size=4)
    add(s, 1, 20)
    add(s, 2, 1)
    assert (s.num_waiting, s.num_running, s.kv_usage) == (2, 0, 0.0)
    step(s)
    assert (s.num_waiting, s.num_running, s.num_free_blocks) == (0, 2, 4)
    assert s.kv_usage == pytest.approx(0.6)
