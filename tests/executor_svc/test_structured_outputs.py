"""The executor's grammar state on the real default model's tokenizer: which rows a fill masks,
what it allows, preemption replay, and a reasoning model's free thinking before its constraint."""
import numpy as np
import pytest

from pagedserve.common.plan import NewRequest
from pagedserve.common.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.executor_svc.structured_outputs import StructuredOutputs
from tests.real_model import smollm2_path

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.load(smollm2_path())


def outputs(model_path, requests: list[NewRequest]) -> StructuredOutputs:
    state = StructuredOutputs(model_path, VOCAB, [EOS], max_seqs=4)
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
