import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.logits import (AllowedTokensTable, GrammarMask, LogitBiasTable, apply_penalties, chunked_logprobs,
                                            gather_logprobs, mask_tokens, step_logprobs)
from pagedserve.executor_svc.model_config import load_model_config
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.weight_loader import load_weights
from tests.executor_svc.harness import logits_rows
from tests.tiny_models import make_tiny_model

VOCAB = 50


def padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [VOCAB] * (width - len(r)) for r in rows])


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float,
                        frequency: float, presence: float) -> torch.Tensor:
    """One row the plain way: transformers' repetition processor, then a loop over the output."""
    processor = RepetitionPenaltyLogitsProcessor(repetition)
    row = processor(torch.tensor([prompt + output]), logits[None].clone())[0]
    for token in output:
        row[token] -= frequency
    for token in set(output):
        row[token] -= presence
    return row


def penalised(logits: torch.Tensor, token_ids: torch.Tensor, num_prompt: torch.Tensor, *penalties) -> torch.Tensor:
    """apply_penalties on every row of a copy of logits."""
    out = logits.clone()
    apply_penalties(out, torch.arange(len(out)), token_ids, num_prompt, *penalties)
    return out


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    # Prompt [0], outputs [1, 1, 2]; token 3 never seen, token 4 seen nowhere either.
    ids = torch.tensor([[0, 1, 1, 2]])
    out = penalised(logits, ids, torch.tensor([1]), torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    expected = torch.tensor([[2.0 / 2, -1.0 * 2 - 2 * 0.5 - 0.25, 0.5 / 2 - 0.5 - 0.25, 3.0, -2.0]])
    torch.testing.assert_close(out, expected)


NEUTRAL = {"repetition": 1.0, "frequency": 0.0, "presence": 0.0}


@pytest.mark.parametrize("penalties", [
    {"repetition": [1.3, 1.0, 2.0, 0.5]}, {"frequency": [0.7, 0.0, 1.0, -2.0]},
    {"presence": [-1.5, 0.0, -0.5, 2.0]},
    {"repetition": [0.6, 1.0, 2.0, 0.5], "frequency": [-0.4, 0.0, 1.0, -2.0],
     "presence": [1.2, 0.0, -0.5, 2.0]},
], ids=["repetition", "frequency", "presence", "all"])
def test_penalties_match_the_reference(penalties):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    prompts = [[1, 2, 3], [4, 4], [7], [9, 10, 11, 12]]
    outputs = [[3, 5, 5, 5], [], [7, 8, 7], [1]]
    # A penalty no row uses travels as None.
    args = {name: torch.tensor(penalties[name]) if name in penalties else None for name in NEUTRAL}
    out = penalised(logits, padded([p + o for p, o in zip(prompts, outputs)]),
                    torch.tensor([len(p) for p in prompts]), *args.values())
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        values = {name: penalties[name][i] if name in penalties else neutral
                  for name, neutral in NEUTRAL.items()}
        expected = reference_penalties(logits[i], prompt, output, **values)
        torch.testing.assert_close(out[i], expected)


def test_penalties_touch_only_their_rows():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    out = logits.clone()
    # Rows 2 and 0 of the batch, in that order; row 0's prompt repeats a token its output has.
    apply_penalties(out, torch.tensor([2, 0]), padded([[5, 6], [9, 9, 3]]), torch.tensor([1, 1]),
                    torch.tensor([1.5, 2.0]), torch.tensor([0.5, 1.0]), torch.tensor([0.25, 0.0]))
    assert torch.equal(out[[1, 3]], logits[[1, 3]])
    torch.testing.assert_close(out[2], reference_penalties(logits[2], [5], [6], 1.5, 0.5, 0.25))
    torch.testing.assert_close(out[0], reference_penalties(logits[0], [9], [9, 3], 2.0, 1.0, 0.0))


def test_neutral_penalties_change_nothing():
    logits = torch.randn(2, VOCAB)
    out = penalised(logits, padded([[1, 2, 3], [4]]), torch.tensor([1, 1]), torch.ones(2), torch.zeros(2),
                    torch.zeros(2))
    assert torch.equal(out, logits)


def test_mask_tokens_sets_only_the_named_entries():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    mask_tokens(logits, torch.tensor([0, 0, 2]), torch.tensor([5, 49, 0]))
    masked = torch.zeros(3, VOCAB, dtype=torch.bool)
    masked[[0, 0, 2], [5, 49, 0]] = True
    assert torch.isneginf(logits[masked]).all()
    assert torch.equal(logits[~masked], before[~masked])


def test_gather_logprobs_are_log_softmax_with_sorted_top_k():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    logprobs = logits.log_softmax(-1)
    sampled = torch.tensor([logits[0].argmax().item(), 7, logits[2].argsort()[-3].item()])
    got = gather_logprobs(logprobs, sampled, 4)
    assert got.values.shape == got.ids.shape == (3, 5)
    torch.testing.assert_close(got.values[:, 0], logprobs[torch.arange(3), sampled])
    expected_ranks = [1, int((logprobs[1] >= logprobs[1, 7]).sum()), 3]
    assert got.ids[:, 0].tolist() == expected_ranks
    for row in range(3):
        order = logprobs[row].argsort(descending=True)[:4]
        assert got.ids[row, 1:].tolist() == order.tolist()
        torch.testing.assert_close(got.values[row, 1:], logprobs[row, order])
    assert (got.values[:, 1:].diff(dim=1) <= 0).all()


def test_gather_logprobs_with_no_top_tokens():
    logprobs = torch.randn(2, VOCAB).log_softmax(-1)
    got = gather_logprobs(logprobs, torch.tensor([3, 4]), 0)
    assert got.values.shape == (2, 1) and got.ids.shape == (2, 1)


def test_step_logprobs_keep_each_rows_own_count():
    values = np.array([[-0.1, -0.2, -0.3, -0.4], [-1.0, -0.5, -0.6, -0.7]], dtype=np.float32)
    ids = np.array([[1, 10, 11, 12], [3, 20, 21, 22]])
    packed = step_logprobs(np.array([0, 2]), np.array([3, 1]), values, ids)
    assert packed.rows == [0, 2] and packed.ranks == [1, 3] and packed.num_top == [3, 1]
    assert packed.top_token_ids == [10, 11, 12, 20]
    np.testing.assert_allclose(packed.logprobs, [-0.1, -1.0])
    np.testing.assert_allclose(packed.top_logprobs, [-0.2, -0.3, -0.4, -0.5])


def test_prompt_logprobs_in_chunks_equal_one_pass(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    model = build_model(load_model_config(path), TorchAttentionBackend(), 64)
    load_weights(model, path, "auto")
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(100, 64, generator=generator)
    # 61 scattered positions: seven chunks of 8 and one of 5.
    index = torch.randperm(100, generator=generator)[:61]
    targets = torch.randint(512, (61,), generator=generator)
    rows = logits_rows(model)
    with torch.inference_mode():
        whole = chunked_logprobs(model.compute_logits, hidden, index, targets, 5, chunk=len(index))
        chunked = chunked_logprobs(model.compute_logits, hidden, index, targets, 5, chunk=8)
    assert rows == [61] + [8] * 7 + [5]
    torch.testing.assert_close(chunked.values, whole.values)
    assert torch.equal(chunked.ids, whole.ids)


def pack(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """The packed int32 bitmask of each row's allowed tokens."""
    words = np.zeros((len(allowed), -(-vocab // 32)), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


def test_grammar_mask_refuses_what_the_bitmask_does_not_allow_in_its_rows_only():
    vocab = 70
    logits = torch.randn(4, vocab)
    before = logits.clone()
    allowed = [{0, 31, 32, 69}, {5}]
    GrammarMask(torch.tensor([1, 3]), pack(allowed, vocab)).apply(logits)
    for row, tokens in zip((1, 3), allowed):
        assert set(torch.isfinite(logits[row]).nonzero().flatten().tolist()) == tokens
        assert torch.equal(logits[row, sorted(tokens)], before[row, sorted(tokens)])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])


def test_allowed_token_ids_leave_only_those_tokens_to_the_rows_that_set_them():
    table = AllowedTokensTable(max_rows=4, vocab_size=70, device=torch.device("cpu"))
    assert not table and table.select(np.array([0, 1]), torch.from_numpy) is None
    table.set(3, [69, 0, 32, 32, 31])
    table.set(1, [5, 70, -1])  # the ids past the vocabulary are dropped
    logits = torch.randn(3, 70)
    before = logits.clone()
    # The batch samples rows 3, 0 and 1 of the table, in that order.
    table.select(np.array([3, 0, 1]), torch.from_numpy).apply(logits)
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == {0, 31, 32, 69}
    assert set(torch.isfinite(logits[2]).nonzero().flatten().tolist()) == {5}
    assert torch.equal(logits[1], before[1]) and torch.equal(logits[0, [0, 31, 32, 69]], before[0, [0, 31, 32, 69]])
    table.clear(3)
    table.set(3, [1])
    logits = torch.zeros(1, 70)
    table.select(np.array([3]), torch.from_numpy).apply(logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1]


def test_logit_bias_adds_to_the_named_tokens_of_the_rows_that_sample():
    table = LogitBiasTable(max_rows=4, vocab_size=6, device=torch.device("cpu"))
    table.set(3, {2: 100.0, 5: -100.0})
    table.set(0, {2: 3.0})
    logits = torch.zeros(3, 6)
    # The batch samples rows 0, 2 and 3 of the table, in that order.
    table.select(np.array([0, 2, 3]), torch.from_numpy).apply(logits)
    expected = torch.zeros(3, 6)
    expected[2, 2], expected[2, 5], expected[0, 2] = 100.0, -100.0, 3.0
    assert torch.equal(logits, expected)
    assert table.select(np.array([1, 2]), torch.from_numpy) is None


def test_a_reused_row_keeps_none_of_its_former_requests_bias():
    table = LogitBiasTable(max_rows=2, vocab_size=8, device=torch.device("cpu"))
    table.set(0, {t: 1.0 for t in range(8)})
    table.clear(0)
    table.set(0, {7: 2.0})
    table.set(1, {t: 0.5 for t in range(5)})
    logits = torch.zeros(2, 8)
    table.select(np.array([0, 1]), torch.from_numpy).apply(logits)
    assert logits[0].tolist() == [0.0] * 7 + [2.0]
    assert logits[1].tolist() == [0.5] * 5 + [0.0] * 3


@pytest.mark.parametrize("seed", range(3))
def test_a_bias_on_one_row_never_changes_another_rows_logits(seed):
    """Ids outside the vocabulary (which the scheduler refuses) are dropped: in the flat logits,
    token vocab + k of row i is token k of row i + 1, another request's."""
    vocab, rows = 16, 5
    rng = np.random.default_rng(seed)
    table = LogitBiasTable(max_rows=rows, vocab_size=vocab, device=torch.device("cpu"))
    row = int(rng.integers(rows))
    ids = rng.integers(-2 * vocab, 3 * vocab, size=12).tolist()
    table.set(row, {t: 100.0 for t in ids})
    logits = torch.randn(rows, vocab)
    before = logits.clone()
    table.select(np.arange(rows), torch.from_numpy).apply(logits)
    others = [r for r in range(rows) if r != row]
    assert torch.equal(logits[others], before[others])
    changed = set((logits[row] != before[row]).nonzero().flatten().tolist())
    assert changed == {t for t in ids if 0 <= t < vocab}
