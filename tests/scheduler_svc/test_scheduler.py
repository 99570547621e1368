from collections import Counter, deque
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.common.plan import StepLogprobs, StepPlan, StepResult
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler_svc.block_manager import NULL_BLOCK
from pagedserve.scheduler_svc.request import Request, RequestOutput, RequestStatus, TokenLogprobs
from pagedserve.scheduler_svc.scheduler import Scheduler
from tests.scheduler_svc.helpers import EOS, add, make_scheduler

VOCAB = 32


def step(s: Scheduler, tokens: dict[int, int] | None = None) -> tuple[StepPlan, list[RequestOutput]]:
    """One step with an executor that samples tokens[seq_id] (default 7) for each completed request."""
    plan = s.schedule()
    # Planning advanced each request: those now computed past their known tokens sample.
    sampled = [r.seq_id for r in plan.new_requests + plan.continuing
               if s.requests[r.seq_id].num_computed_tokens >= len(s.requests[r.seq_id].token_ids)]
    tokens = tokens or {}
    result = StepResult(plan.step_id, sampled, [tokens.get(seq_id, 7) for seq_id in sampled])
    return plan, s.update(plan, result)


def scheduled(plan: StepPlan) -> dict[int, int]:
    return {r.seq_id: r.num_scheduled_tokens for r in plan.new_requests + plan.continuing}


def test_token_budget_is_respected():
    s = make_scheduler(max_num_batched_tokens=10)
    for seq_id in range(1, 5):
        add(s, seq_id, 6, first_token=10 * seq_id)
    plan, _ = step(s)
    assert scheduled(plan) == {1: 6, 2: 4}
    for _ in range(20):
        plan, _ = step(s)
        assert 0 < plan.num_tokens <= 10


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


def run_to_end(s: Scheduler, tokens: list[int]) -> list[RequestOutput]:
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


# --- Randomized: a fake executor that tracks plan deltas and keeps a fake KV cache ---------------


def next_token(token_ids: list[int]) -> int:
    """The fake model: a pure function of the whole sequence, like greedy decoding."""
    return hash(tuple(token_ids)) % VOCAB


@dataclass
class SeqState:
    token_ids: list[int]
    num_computed: int
    block_ids: list[int]


class FakeExecutor:
    """Keeps per-seq state from plan deltas as the real executor does, and a KV cache whose slots
    hold the token computed there: sampling reads the sequence back through the block table."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: dict[int, SeqState] = {}

    def read(self, seq: SeqState, end: int) -> list[int | None]:
        bs = self.block_size
        return [self.kv[seq.block_ids[p // bs]][p % bs] for p in range(end)]

    def run(self, plan: StepPlan) -> StepResult:
        bs = self.block_size
        for seq_id in plan.dropped:
            assert seq_id in self.seqs, f"dropped unknown seq {seq_id}"
            del self.seqs[seq_id]
        work = []
        for r in plan.new_requests:
            assert r.seq_id not in self.seqs, f"seq {r.seq_id} sent twice"
            self.seqs[r.seq_id] = SeqState(list(r.token_ids), r.num_computed_tokens, list(r.block_ids))
            work.append((r.seq_id, r.num_scheduled_tokens))
        for r in plan.continuing:
            assert r.seq_id in self.seqs, f"continuing unknown seq {r.seq_id}"
            self.seqs[r.seq_id].block_ids += r.new_block_ids
            work.append((r.seq_id, r.num_scheduled_tokens))
        # Like the model: every scheduled token's KV is written before any attention reads the
        # cache, so a prefix hit on a block another request fills in this same step is valid.
        for seq_id, n in work:
            seq = self.seqs[seq_id]
            end = seq.num_computed + n
            assert n > 0 and end <= len(seq.token_ids)
            assert len(seq.block_ids) == -(-end // bs), "blocks must cover exactly the scheduled tokens"
            for p in range(seq.num_computed, end):
                self.kv[seq.block_ids[p // bs]][p % bs] = seq.token_ids[p]
        for r in plan.new_requests:
            seq = self.seqs[r.seq_id]
            assert self.read(seq, seq.num_computed) == seq.token_ids[:seq.num_computed], "bad cache hit"
        for seq_id, n in work:
            self.seqs[seq_id].num_computed += n
        holders = Counter(b for seq in self.seqs.values() for b in seq.block_ids)
        assert NULL_BLOCK not in holders
        for seq in self.seqs.values():
            for i, b in enumerate(seq.block_ids):
                # A block may be shared only through the prefix cache: full of computed tokens.
                assert holders[b] == 1 or (i + 1) * bs <= seq.num_computed, f"block {b} shared"
        result = StepResult(plan.step_id)
        for seq_id, _ in work:
            seq = self.seqs[seq_id]
            end = seq.num_computed
            if end == len(seq.token_ids):
                token = next_token(self.read(seq, end))
                seq.token_ids.append(token)
                result.seq_ids.append(seq_id)
                result.token_ids.append(token)
        return result


def reference(prompt: list[int], p: SamplingParams, max_len: int) -> tuple[list[int], str]:
    token_ids, out = list(prompt), []
    while True:
        token = next_token(token_ids)
        token_ids.append(token)
        out.append(token)
        if len(out) >= p.min_tokens and (token in p.stop_token_ids or (not p.ignore_eos and token == EOS)):
            return out, "stop"
        if p.max_tokens is not None and len(out) >= p.max_tokens or len(token_ids) >= max_len:
            return out, "length"


def check_pool(s: Scheduler) -> None:
    bm = s.block_manager
    refs = Counter(b for r in s.running for b in r.block_ids)
    assert all(not r.block_ids for r in s.waiting)
    assert all(bm.blocks[b].ref_count == refs[b] for b in range(1, len(bm.blocks)))
    assert set(bm.free_ids) == {b for b in range(1, len(bm.blocks)) if refs[b] == 0}


@dataclass
class Spec:
    arrival: int
    prompt: list[int]
    params: SamplingParams
    abort_at: tuple[int, bool] | None


any_token = st.integers(0, VOCAB - 1)


@st.composite
def specs(draw, prefixes: list[list[int]]) -> Spec:
    prefix = draw(st.sampled_from(prefixes + [[]]))
    prompt = prefix + draw(st.lists(any_token, min_size=0 if prefix else 1, max_size=20))
    max_tokens = draw(st.none() | st.integers(1, 24))
    params = SamplingParams(max_tokens=max_tokens, min_tokens=draw(st.integers(0, 3)),
                            stop_token_ids=draw(st.lists(any_token, max_size=2)), ignore_eos=draw(st.booleans()))
    abort_at = draw(st.none() | st.tuples(st.integers(0, 40), st.booleans()))
    return Spec(draw(st.integers(0, 10)), prompt, params, abort_at)


@st.composite
def workloads(draw) -> tuple[dict, list[Spec]]:
    engine = {"block_size": draw(st.sampled_from([1, 2, 4, 8])), "num_blocks": draw(st.integers(2, 12)),
              "max_model_len": draw(st.integers(8, 64)), "max_num_seqs": draw(st.integers(1, 6)),
              "max_num_batched_tokens": draw(st.integers(1, 32)),
              "enable_prefix_caching": draw(st.booleans())}
    prefixes = draw(st.lists(st.lists(any_token, min_size=1, max_size=24), min_size=1, max_size=3))
    return engine, draw(st.lists(specs(prefixes), min_size=2, max_size=12))


def abort_due(s: Scheduler, accepted: dict[str, Spec], when: tuple[int, bool]) -> set[str]:
    return {request_id for request_id, spec in accepted.items() if spec.abort_at == when and s.abort(request_id)}


MAX_STEPS = 5000


@pytest.mark.parametrize("max_in_flight", [1, 2])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_random_workloads_match_the_unpreempted_reference(max_in_flight, workload):
    """With max_in_flight 2, each plan is made before the previous step's result is applied, and
    the fake executor feeds each step the tokens it sampled itself, as the pipelined engine does."""
    engine, requests = workload
    s = make_scheduler(**engine)
    executor = FakeExecutor(engine["num_blocks"], engine["block_size"])
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    aborted: set[str] = set()
    accepted: dict[str, Spec] = {}
    in_flight: deque[tuple[StepPlan, StepResult]] = deque()

    def apply_oldest() -> None:
        plan, result = in_flight.popleft()
        for out in s.update(plan, result):
            assert out.request_id not in finish
            outputs[out.request_id] += out.new_token_ids
            assert out.num_output_tokens == len(outputs[out.request_id])
            if out.finished:
                finish[out.request_id] = out.finish_reason
        check_pool(s)

    for step_id in range(MAX_STEPS):
        if step_id > max(r.arrival for r in requests) and not s.has_work() and not in_flight:
            break
        for i, spec in enumerate(requests):
            if spec.arrival == step_id:
                request = Request(i + 1, f"r{i}", spec.prompt, spec.params)
                if len(spec.prompt) >= s.max_len:
                    with pytest.raises(ValueError, match="shorten it"):
                        s.add(request)
                else:
                    s.add(request)
                    accepted[request.request_id] = spec
                    outputs[request.request_id] = []
        aborted |= abort_due(s, accepted, (step_id, False))
        plan = s.schedule()
        check_pool(s)
        assert plan.num_tokens <= engine["max_num_batched_tokens"]
        assert len(plan.new_requests) + len(plan.continuing) <= engine["max_num_seqs"]
        aborted |= abort_due(s, accepted, (step_id, True))
        in_flight.append((plan, executor.run(plan)))
        assert set(executor.seqs) == {r.seq_id for r in s.running} | set(s.dropped)
        for r in s.running:
            assert executor.seqs[r.seq_id].block_ids == r.block_ids
        while len(in_flight) >= max_in_flight or (in_flight and not s.has_work()):
            apply_oldest()
    else:
        pytest.fail(f"requests still unfinished after {MAX_STEPS} steps")

    assert not executor.seqs
    assert s.num_free_blocks == engine["num_blocks"] - 1 and s.kv_usage == 0.0
    for request_id, spec in accepted.items():
        expected, reason = reference(spec.prompt, spec.params, s.max_len)
        if request_id in aborted:
            assert expected[:len(outputs[request_id])] == outputs[request_id]
            assert request_id not in finish
        else:
            assert (outputs[request_id], finish[request_id]) == (expected, reason)
