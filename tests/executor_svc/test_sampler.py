import math

import numpy as np
import pytest
import torch

from pagedserve.executor_svc.logits import LogprobRows, Penalties
from pagedserve.executor_svc.sampler import (Sampler, SamplingBatch, make_sampling_batch, sample_exponential,
                                             top_k_top_p_by_threshold, top_k_top_p_sorted)
from pagedserve.common.sampling_params import SamplingParams
from tests.kernels.kernel_testing import DEVICE

sampler = Sampler()


def sample(logits: torch.Tensor, options: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    def column(name: str, dtype) -> np.ndarray:
        return np.array([getattr(o, name) for o in options], dtype=dtype)

    batch = make_sampling_batch(column("temperature", np.float32), column("top_p", np.float32),
                                column("top_k", np.int64), column("min_p", np.float32),
                                {i: g for i, g in enumerate(generators) if g is not None},
                                lambda a: torch.from_numpy(a))
    return sampler(logits, batch).tokens


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def frequencies(logits: torch.Tensor, options: SamplingParams, draws: int = 20000) -> torch.Tensor:
    """How often each token is drawn from one row of logits, over `draws` rows at once."""
    torch.manual_seed(0)
    tokens = sample(logits.expand(draws, -1).clone(), [options] * draws, [None] * draws)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / draws


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, 300, generator=seeded(0)) * 3


def test_greedy_rows_take_the_argmax(logits):
    options = [SamplingParams(temperature=0.0)] * 6
    assert torch.equal(sample(logits, options, [None] * 6), logits.argmax(-1))


def test_greedy_rows_stay_argmax_next_to_sampled_rows(logits):
    options = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)] * 3
    tokens = sample(logits, options, [None, seeded(1)] * 3)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))


def test_top_k_1_and_tiny_top_p_are_greedy(logits):
    expected = logits.argmax(-1)
    for options in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        for _ in range(5):
            assert torch.equal(sample(logits, [options] * 6, [None] * 6), expected)


def test_same_seed_same_tokens_different_seed_differs(logits):
    options = [SamplingParams(temperature=1.5, top_k=50)] * 6

    def draw(seed: int) -> list[list[int]]:
        generators = [seeded(seed + row) for row in range(6)]
        return [sample(logits, options, generators).tolist() for _ in range(4)]

    assert draw(10) == draw(10)
    assert draw(10) != draw(11)


def test_seeded_row_ignores_the_rest_of_the_batch(logits):
    options = SamplingParams(temperature=1.0, top_p=0.9, seed=3)

    def first_row_draws(rows: torch.Tensor, others: list[SamplingParams]) -> list[int]:
        generator = seeded(3)
        return [sample(rows, [options] + others, [generator] + [None] * len(others))[0].item()
                for _ in range(5)]

    alone = first_row_draws(logits[:1], [])
    torch.manual_seed(123)
    assert first_row_draws(logits, [SamplingParams(temperature=1.0)] * 5) == alone


def test_a_gpu_draw_of_a_seeded_row_depends_on_its_seed_alone(logits):
    # The GPU's draw, run here by Triton's interpreter: the kernel draws from a seed a row, taken
    # from the request's generator where it has one.
    logits = logits.to(DEVICE)

    def first_row_draws(rows: torch.Tensor) -> list[int]:
        generator = torch.Generator(DEVICE).manual_seed(3)
        return [sample_exponential(rows, {0: generator})[0].item() for _ in range(5)]

    alone = first_row_draws(logits[:1])
    torch.manual_seed(123)
    assert first_row_draws(logits) == alone
    assert len(set(alone)) > 1


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    observed = frequencies(logits, SamplingParams(temperature=0.7))
    torch.testing.assert_close(observed, expected, atol=0.015, rtol=0)


def test_masked_tokens_are_never_drawn_at_either_end_of_a_long_vocabulary():
    # The default model's vocabulary, allowed tokens at both ends and one with almost no mass.
    logits = torch.full((1, 49152), float("-inf"))
    allowed = [0, 1, 30000, 49151]
    logits[0, allowed] = torch.tensor([0.0, -30.0, 1.0, 0.5])
    # Fewer draws than elsewhere: each is a row of the whole vocabulary.
    observed = frequencies(logits, SamplingParams(), draws=1500)
    assert set(observed.nonzero().flatten().tolist()) <= set(allowed)
    expected = torch.softmax(logits[0, allowed], dim=-1)
    torch.testing.assert_close(observed[allowed], expected, atol=0.05, rtol=0)


def test_a_row_with_one_allowed_token_draws_it():
    for token in (0, 7, 299):
        logits = torch.full((4000, 300), float("-inf"))
        logits[:, token] = 0.0
        assert set(sample(logits, [SamplingParams()] * 4000, [None] * 4000).tolist()) == {token}


def test_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([[3.0, 0.0, 2.0, 1.0, 2.5]])
    observed = frequencies(logits, SamplingParams(top_k=3))
    expected = torch.zeros(5)
    expected[[0, 2, 4]] = torch.softmax(logits[0, [0, 2, 4]], dim=-1)
    torch.testing.assert_close(observed, expected, atol=0.015, rtol=0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.1, 0.5, 0.1, 0.3]])
    observed = frequencies(probs.log(), SamplingParams(top_p=0.7))
    torch.testing.assert_close(observed, torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=0.015, rtol=0)


def test_top_k_and_top_p_combine():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    observed = frequencies(probs.log(), SamplingParams(top_k=3, top_p=0.95))
    torch.testing.assert_close(observed, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0]), atol=0.015, rtol=0)


@pytest.mark.parametrize("top_k", [0, 1, 7, 299, 300, 400])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_the_cpu_threshold_cut_keeps_what_the_sort_keeps(top_k, top_p):
    logits = torch.randn(64, 300, generator=seeded(top_k)) * 3
    k, p = torch.full((64,), top_k), torch.full((64,), top_p)
    kept = ~top_k_top_p_by_threshold(logits, k, p).isinf()
    assert torch.equal(kept, ~top_k_top_p_sorted(logits, k, p).isinf())
    torch.testing.assert_close(top_k_top_p_by_threshold(logits, k, p)[kept], logits[kept], rtol=0, atol=0)


def test_the_cpu_threshold_cut_keeps_ties_and_the_whole_top_k_at_top_p_1():
    logits = torch.tensor([[4.0, 1.0, 1.0, 1.0, 0.0]] * 2 + [[float(-i) for i in range(5)]])
    cut = top_k_top_p_by_threshold(logits, torch.tensor([0, 2, 4]), torch.tensor([0.9, 1.0, 1.0]))
    assert (~cut.isinf()).tolist() == [[True, True, True, True, False], [True, True, True, True, False],
                                       [True, True, True, True, False]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs = torch.tensor([[0.05, 0.4, 0.25, 0.3]])
    observed = frequencies(probs.log(), SamplingParams(min_p=0.7))
    torch.testing.assert_close(observed, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]), atol=0.015, rtol=0)


def test_rows_mix_top_k_top_p_and_plain_sampling():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3)
    options = [SamplingParams(top_k=1), SamplingParams(top_p=0.5), SamplingParams()]
    torch.manual_seed(0)
    draws = sample(probs.log().repeat(400, 1), options * 400, [None] * 1200).view(400, 3)
    assert set(draws[:, 0].tolist()) == {0}
    assert set(draws[:, 1].tolist()) == {0, 1}
    assert set(draws[:, 2].tolist()) == {0, 1, 2, 3}


def test_top_k_rows_next_to_unrestricted_rows():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3)
    options = [SamplingParams(top_k=2), SamplingParams(top_k=0), SamplingParams(top_k=9)]
    torch.manual_seed(0)
    draws = sample(probs.log().repeat(400, 1), options * 400, [None] * 1200).view(400, 3)
    assert set(draws[:, 0].tolist()) == {0, 1}
    assert set(draws[:, 1].tolist()) == set(draws[:, 2].tolist()) == {0, 1, 2, 3}


def test_stop_mask_and_penalties_steer_the_sample_but_logprobs_stay_raw():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0], [0.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    raw = logits.log_softmax(-1)
    batch = SamplingBatch(
        all_greedy=True,
        # Row 0 may not end yet (token 0 is its stop); row 1 has prompt [0] and output [1]
        # (then padding), whose logits a repetition penalty of 4 shrinks.
        token_mask=torch.tensor([[0], [0]]),
        penalties=Penalties(torch.tensor([1]), torch.tensor([[0, 1, 4]]), torch.tensor([1]),
                            torch.tensor([4.0]), None, None),
        logprobs=LogprobRows(np.array([0, 1]), torch.tensor([0, 1]), np.array([2, 1])))
    out = sampler(logits.clone(), batch)
    assert out.tokens.tolist() == [1, 2, 3]
    torch.testing.assert_close(out.logprobs.values[:, 0], raw[[0, 1], [1, 2]])
    assert out.logprobs.ids[:, 0].tolist() == [2, 2]
    assert out.logprobs.ids[:, 1:].tolist() == [[0, 1], [1, 2]]
    torch.testing.assert_close(out.logprobs.values[:, 1:], raw[[[0], [1]], [[0, 1], [1, 2]]])


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_mode_picks_raw_or_processed_logprobs_or_logits(mode):
    # Row 0 is greedy under a repetition penalty of 4 on token 1; row 1 samples at temperature 0.5
    # from its top 2 (tokens 3 and 2).
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    batch = make_sampling_batch(np.array([0.0, 0.5], np.float32), np.ones(2, np.float32), np.array([0, 2]),
                                np.zeros(2, np.float32), {1: seeded(1)}, lambda a: torch.from_numpy(a))
    batch.penalties = Penalties(torch.tensor([0]), torch.tensor([[1]]), torch.tensor([0]), torch.tensor([4.0]),
                                None, None)
    batch.logprobs = LogprobRows(np.array([0, 1]), torch.tensor([0, 1]), np.array([4, 4]))
    out = Sampler(mode)(logits.clone(), batch)
    processed = torch.tensor([[5.0, 1.0, 1.0, 0.0], [-math.inf, -math.inf, 6.0, 8.0]])
    expected = {"raw_logprobs": logits.log_softmax(-1), "raw_logits": logits,
                "processed_logprobs": processed.log_softmax(-1), "processed_logits": processed}[mode]
    tokens = out.tokens.tolist()
    assert tokens[0] == 0 and tokens[1] in (2, 3)
    torch.testing.assert_close(out.logprobs.values[:, 0], expected[[0, 1], tokens])
    torch.testing.assert_close(out.logprobs.values[:, 1:], expected.sort(-1, descending=True).values)
    # vLLM's rank: how many tokens are at least as likely as the sampled one.
    assert out.logprobs.ids[:, 0].tolist() == [int((row >= row[t]).sum()) for row, t in zip(expected, tokens)]


def test_without_logprobs_asked_none_come_back(logits):
    assert sampler(logits, SamplingBatch(all_greedy=True)).logprobs is None


@pytest.mark.parametrize("temperatures, divides", [([1.0, 0.0, 1.0], False), ([1.0, 0.7, 0.0], True)])
def test_the_temperature_pass_runs_only_when_a_sampled_row_needs_it(temperatures, divides):
    n = len(temperatures)
    batch = make_sampling_batch(np.array(temperatures, np.float32), np.ones(n, np.float32),
                                np.zeros(n, np.int64), np.zeros(n, np.float32), {},
                                lambda a: torch.from_numpy(a))
    assert (batch.temperature is not None) == divides


# A temperature scales the kernel's noise instead of dividing the logits; a cut or logprobs need them
# divided.
@pytest.mark.parametrize("temperatures, top_k, logprobs, argmax_only", [
    ([0.0, 0.0], 0, False, True), ([1.0, 0.0], 0, False, True), ([0.7, 1.0], 0, False, True),
    ([0.7, 0.0], 5, False, False), ([1.0, 1.0], 5, False, False), ([0.0, 0.0], 0, True, False)])
def test_only_rows_that_take_a_plain_argmax_leave_the_logits_unedited(temperatures, top_k, logprobs,
                                                                      argmax_only):
    n = len(temperatures)
    batch = make_sampling_batch(np.array(temperatures, np.float32), np.ones(n, np.float32),
                                np.full(n, top_k, np.int64), np.zeros(n, np.float32), {},
                                lambda a: torch.from_numpy(a))
    if logprobs:
        batch.logprobs = LogprobRows(np.array([0]), torch.tensor([0]), np.array([1]))
    assert batch.takes_argmax_only() == argmax_only


def test_bfloat16_logits_are_widened_before_logprobs_and_temperature():
    logits = (torch.randn(3, 500, generator=seeded(2)) * 4).to(torch.bfloat16).to(DEVICE)
    batch = make_sampling_batch(np.array([0.0, 0.5, 0.0], np.float32), np.ones(3, np.float32),
                                np.zeros(3, np.int64), np.zeros(3, np.float32), {},
                                lambda a: torch.from_numpy(a).to(DEVICE))
    batch.logprobs = LogprobRows(np.array([0, 2]), torch.tensor([0, 2], device=DEVICE), np.array([3, 3]))
    out = sampler(logits, batch)
    assert out.logprobs.values.dtype == torch.float32
    expected = logits.float().log_softmax(-1)[[0, 2]]
    torch.testing.assert_close(out.logprobs.values[:, 1:], expected.sort(-1, descending=True).values[:, :3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sampler folds temperatures into its noise on a GPU only")
def test_gpu_rows_at_a_temperature_draw_from_its_softmax_beside_greedy_rows():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]], device="cuda").expand(20000, -1).contiguous()
    temperatures = np.where(np.arange(20000) % 2 == 0, 0.0, 0.7).astype(np.float32)
    batch = make_sampling_batch(temperatures, np.ones(20000, np.float32), np.zeros(20000, np.int64),
                                np.zeros(20000, np.float32), {}, lambda a: torch.from_numpy(a).cuda())
    assert batch.takes_argmax_only()
    tokens = sampler(logits, batch).tokens.cpu()
    assert (tokens[::2] == 0).all()
    observed = torch.bincount(tokens[1::2], minlength=5).float() / 10000
    torch.testing.assert_close(observed, torch.softmax(logits[0].cpu() / 0.7, dim=-1), atol=0.02, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sampler reads narrow logits on a GPU only")
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_bfloat16_logits_draw_what_their_float32_widening_draws(temperature):
    # Plain rows read the model dtype where the kernel widens each value: the same seeds must
    # draw the same tokens as from a float32 copy.
    logits = (torch.randn(64, 128_256, device="cuda") * 3).to(torch.bfloat16)

    def draw(rows: torch.Tensor) -> torch.Tensor:
        generators = {row: torch.Generator("cuda").manual_seed(row) for row in range(64)}
        batch = make_sampling_batch(np.full(64, temperature, np.float32), np.ones(64, np.float32),
                                    np.zeros(64, np.int64), np.zeros(64, np.float32), generators,
                                    lambda a: torch.from_numpy(a).cuda())
        assert batch.takes_argmax_only()
        return sampler(rows, batch).tokens

    assert torch.equal(draw(logits), draw(logits.float()))
