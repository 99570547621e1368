"""Randomized workloads through the scheduler and a fake executor, one or two steps in flight, under
either scheduling policy with interactive and background requests: every request's tokens and finish
reason must equal an unpreempted reference run, and the block pool must stay consistent after every
step."""
from collections import Counter, deque
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.common.plan import StepPlan, StepResult
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler_svc.request import Request
from pagedserve.scheduler_svc.scheduler import Scheduler
from tests.scheduler_svc.fake_executor import VOCAB, FakeExecutor, next_token
from tests.scheduler_svc.helpers import EOS, make_scheduler


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
    assert all(not r.block_ids for r in s.waiting + s.waiting_background)
    # Interactive requests lead the running list, which is what makes its end the preemption victim.
    assert [r.background for r in s.running] == sorted(r.background for r in s.running)
    assert all(bm.blocks[b].ref_count == refs[b] for b in range(1, len(bm.blocks)))
    assert set(bm.free_ids) == {b for b in range(1, len(bm.blocks)) if refs[b] == 0}


@dataclass
class Spec:
    arrival: int
    prompt: list[int]
    params: SamplingParams
    abort_at: tuple[int, bool] | None
    priority: int
    background: bool


any_token = st.integers(0, VOCAB - 1)


@st.composite
def specs(draw, prefixes: list[list[int]]) -> Spec:
    prefix = draw(st.sampled_from(prefixes + [[]]))
    prompt = prefix + draw(st.lists(any_token, min_size=0 if prefix else 1, max_size=20))
    max_tokens = draw(st.none() | st.integers(1, 24))
    params = SamplingParams(max_tokens=max_tokens, min_tokens=draw(st.integers(0, 3)),
                            stop_token_ids=draw(st.lists(any_token, max_size=2)), ignore_eos=draw(st.booleans()))
    abort_at = draw(st.none() | st.tuples(st.integers(0, 40), st.booleans()))
    return Spec(draw(st.integers(0, 10)), prompt, params, abort_at, draw(st.integers(-2, 2)), draw(st.booleans()))


@st.composite
def workloads(draw) -> tuple[dict, list[Spec]]:
    engine = {"block_size": draw(st.sampled_from([1, 2, 4, 8])), "num_blocks": draw(st.integers(2, 12)),
              "max_model_len": draw(st.integers(8, 64)), "max_num_seqs": draw(st.integers(1, 6)),
              "max_num_batched_tokens": draw(st.integers(1, 32)),
              "enable_prefix_caching": draw(st.booleans()),
              "scheduling_policy": draw(st.sampled_from(["fcfs", "priority"]))}
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
    the fake executor feeds each step the tokens it sampled itself, as the pipelined engine does.
    The loop is written out here, not StepLoop's, to add and abort requests between the phases of
    a step and check the pool after each."""
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
                priority = spec.priority if engine["scheduling_policy"] == "priority" else 0
                request = Request(i + 1, f"r{i}", spec.prompt, spec.params, priority=priority,
                                  background=spec.background)
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
        if s.waiting:
            assert not any(s.requests[r.seq_id].background for r in plan.new_requests)
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
