"""The executor's grammar state on the real default model's tokenizer: which rows a fill masks,
what it allows, preemption replay, and a reasoning model's free thinking before its constraint;
and in the runner, a grammar still compiling or failing to compile affects its own row only."""
import threading
import time

import numpy as np
import pytest

from pagedserve.common.grammar import GrammarCompiler
from pagedserve.common.plan import INVALID_ARGUMENT, ContinuingRequest, NewRequest, StepPlan
from pagedserve.common.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.executor_svc.structured_outputs import StructuredOutputs
from tests.executor_svc.harness import make_worker, random_prompts
from tests.gateway.fake_engine import build_tiny_tokenizer
from tests.real_model import smollm2_path
from tests.tiny_models import make_tiny_model

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.load(smollm2_path())


def outputs(model_path, requests: list[NewRequest]) -> StructuredOutputs:
    # Without deferring, a fill waits for the grammar, as with tensor parallelism.
    state = StructuredOutputs(model_path, VOCAB, [EOS], max_seqs=4, defer=False)
    for r in requests:
        state.add(r)
    return state


def request(seq_id: int, tokenizer, outputs_text: str = "", **constraint) -> NewRequest:
    prompt = tokenizer.encode("Answer:", add_special_tokens=False)
    done = tokenizer.encode(outputs_text, add_special_tokens=False) if outputs_text else []
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)) if constraint else SamplingParams()
    return NewRequest(seq_id, prompt + done, 0, len(prompt) + len(done), [0], params, len(prompt))


def allowed(bitmask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB]).tolist())


def texts(tokenizer, ids: set[int]) -> set[str]:
    return {tokenizer.decode([i]) for i in ids}


def test_fill_masks_the_constrained_rows_only(tokenizer):
    state = outputs(smollm2_path(), [request(1, tokenizer), request(2, tokenizer, choice=["yes", "no"])])
    index, bitmask = state.fill(np.array([1, 2]))
    assert index.tolist() == [1]
    first = texts(tokenizer, allowed(bitmask[0]))
    assert all("yes".startswith(t) or "no".startswith(t) for t in first) and {"yes", "no"} & first
    yes = tokenizer.encode("yes", add_special_tokens=False)
    state.accept(np.array([1, 2]), np.array([5, yes[0]]))
    for token in yes[1:]:
        state.accept(np.array([2]), np.array([token]))
    _, bitmask = state.fill(np.array([2]))
    assert allowed(bitmask[0]) == {EOS}
    state.remove(2)
    assert state.fill(np.array([1])) is None and not state


def test_a_preempted_request_replays_its_outputs(tokenizer):
    state = outputs(smollm2_path(), [request(3, tokenizer, "ye", choice=["yes", "no"])])
    _, bitmask = state.fill(np.array([3]))
    assert texts(tokenizer, allowed(bitmask[0])) == {"s"}


def test_the_thinking_stays_free_until_its_end_tokens(tokenizer):
    end = tokenizer.encode("</think>", add_special_tokens=False)
    state = outputs(smollm2_path(), [request(4, tokenizer, choice=["yes", "no"], reasoning_end_ids=end)])
    thinking = tokenizer.encode("<think>plan", add_special_tokens=False) + end[:-1]
    for token in thinking:
        assert state.fill(np.array([4])) is None
        state.accept(np.array([4]), np.array([token]))
    state.accept(np.array([4]), np.array([end[-1]]))
    index, bitmask = state.fill(np.array([4]))
    assert index.tolist() == [0] and {"yes", "no"} & texts(tokenizer, allowed(bitmask[0]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model with a tiny tokenizer of its own (300 tokens in its 512-token vocabulary)."""
    path = make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny"))
    build_tiny_tokenizer(path)
    return path


def test_a_slow_grammar_defers_its_row_without_holding_the_others(tiny):
    worker = make_worker(tiny)
    runner = worker.runner
    gate = threading.Event()

    def slow_tokenizer() -> Tokenizer:
        # The grammar cannot compile before the gate opens; a step that waited for it would sit
        # out the whole timeout here, then sample the row (so not defer it).
        gate.wait(10)
        return Tokenizer.load(tiny)

    runner.structured._compiler = GrammarCompiler(slow_tokenizer, 512, [2])
    prompt = random_prompts([6])[0]
    digits = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))
    first = worker.run(StepPlan(1, new_requests=[NewRequest(1, prompt, 0, 6, [1], SamplingParams(temperature=0)),
                                                 NewRequest(2, prompt, 0, 6, [2], digits)]))
    again = StepPlan(2, continuing=[ContinuingRequest(1, 1, []), ContinuingRequest(2, 1, [])])
    second = worker.run(again)
    assert not gate.is_set() and first.deferred == second.deferred == [2]
    assert first.seq_ids == second.seq_ids == [1, 2] and not first.errors
    gate.set()
    runner.structured.matchers[2].result(timeout=30)
    third = worker.run(StepPlan(3, continuing=again.continuing))
    assert third.deferred == []
    assert Tokenizer.load(tiny).decode([third.token_ids[1]]).isdigit()
    assert runner.batch.num_tokens[runner.batch.rows[2]] == 7 and runner.batch.num_tokens[runner.batch.rows[1]] == 9


def test_a_grammar_that_cannot_compile_fails_its_request_alone(tiny):
    worker = make_worker(tiny)
    runner = worker.runner
    prompt = random_prompts([5])[0]
    broken = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    plan = StepPlan(1, new_requests=[NewRequest(1, prompt, 0, 5, [1, 2], SamplingParams()),
                                     NewRequest(2, prompt, 0, 5, [3, 4], broken)])
    continuing = [ContinuingRequest(1, 1, []), ContinuingRequest(2, 1, [])]
    for step_id in range(2, 10):
        result = worker.run(plan)
        assert result.seq_ids == [1, 2]
        if result.errors:
            break
        # Still compiling (the tokenizer loads first, on a worker): the row waits, the other goes on.
        assert result.deferred == [2]
        time.sleep(0.1)
        plan = StepPlan(step_id, continuing=continuing)
    assert [(e.seq_id, e.code) for e in result.errors] == [(2, INVALID_ARGUMENT)]
    assert "cannot be compiled" in result.errors[0].message and not runner.structured
    result = worker.run(StepPlan(step_id, continuing=continuing[:1], dropped=[2]))
    assert result.seq_ids == [1] and not result.errors
