import numpy as np
import pytest
import torch

from tests.kernels.kernel_testing import DEVICE
from pagedserve.kernels.argmax import CHUNK, argmax


@pytest.mark.parametrize("num_rows, vocab", [(1, 3 * CHUNK + 77), (5, 1000), (3, 2 * CHUNK)])
def test_argmax_matches_torch(num_rows: int, vocab: int) -> None:
    x = torch.randn(num_rows, vocab, device=DEVICE) * 4
    # A row whose maximum sits in the last, partial chunk; one with masked (-inf) tokens.
    x[0, -1] = 100.0
    if num_rows > 1:
        x[1, : vocab // 2] = float("-inf")
    assert torch.equal(argmax(x), x.argmax(dim=-1))


def philox4x32(seed: int, counters: np.ndarray) -> list[np.ndarray]:
    """Philox4x32-10 (Salmon et al. 2011) as triton's randint4x runs it: the counter (offset,
    0, 0, 0) under the 64-bit key `seed`."""
    key = [np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)]
    c = [counters.astype(np.uint64), *(np.zeros(len(counters), np.uint64) for _ in range(3))]
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        a, b = c[0] * np.uint64(0xD2511F53), c[2] * np.uint64(0xCD9E8D57)
        c = [(b >> np.uint64(32)) ^ c[1] ^ key[0], b & mask, (a >> np.uint64(32)) ^ c[3] ^ key[1], a & mask]
        key = [(key[0] + np.uint64(0x9E3779B9)) & mask, (key[1] + np.uint64(0xBB67AE85)) & mask]
    return c


def gumbel_argmax_ref(logits: torch.Tensor, seeds: torch.Tensor, scales: list[float] | None = None) -> list[int]:
    """argmax(logits - T log E) with E = -log(U) from the row's Philox draws (element i of chunk j
    takes draw i // QUARTER of the call at counter j * QUARTER + i % QUARTER) and T the row's scale, 1
    unless given."""
    quarter = CHUNK // 4
    tokens = []
    scales = scales or [1.0] * len(logits)
    for row, seed, scale in zip(logits.double().cpu().numpy(), seeds.tolist(), scales):
        i = np.arange(len(row))
        draws = np.stack(philox4x32(seed, i // CHUNK * quarter + i % quarter))
        bits = draws[i % CHUNK // quarter, i].astype(np.float64)
        u = (np.floor(bits / 512) + 0.5) / 2**23
        tokens.append(int(np.argmax(row - scale * np.log(-np.log(u)))))
    return tokens


def test_sampled_argmax_is_argmax_of_logits_minus_log_philox_exponentials() -> None:
    logits = torch.randn(4, 3 * CHUNK + 5, device=DEVICE) * 4
    logits[1, CHUNK:] = float("-inf")
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**62 - 1], device=DEVICE)
    tokens = argmax(logits, seeds).tolist()
    assert tokens == gumbel_argmax_ref(logits, seeds)
    assert tokens[1] < CHUNK


def test_scaled_noise_draws_at_each_rows_temperature() -> None:
    logits = torch.randn(6, 2 * CHUNK + 5, device=DEVICE) * 4
    seeds = torch.tensor([5, 6, 7, 8, 9, 10], device=DEVICE)
    scales = [0.0, 0.5, 1.0, 2.0, 0.25, 3.0]
    tokens = argmax(logits, seeds, torch.tensor(scales, device=DEVICE)).tolist()
    assert tokens == gumbel_argmax_ref(logits, seeds, scales)
    assert tokens[0] == logits[0].argmax().item()
    assert tokens[2] == argmax(logits[2:3], seeds[2:3]).item()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_kernels_draws_follow_softmax(temperature: float) -> None:
    # Through the reference, which the tests above hold the kernel to (the interpreter takes
    # about 17 ms a row).
    base = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0], dtype=torch.float64)
    logits = base.log().expand(2000, -1)
    draws = gumbel_argmax_ref(logits, torch.arange(2000) * 7919, [temperature] * 2000)
    counts = torch.bincount(torch.tensor(draws), minlength=5)
    tempered = torch.softmax(logits[0] / temperature, dim=-1)
    expected = 2000 * tempered
    # Within five standard deviations of a binomial count; the zero-probability token never.
    assert ((counts - expected).abs() <= 5 * (expected * (1 - tempered)).sqrt()).all(), counts.tolist()
    assert counts[4] == 0


def test_argmax_ties_pick_the_first_token_across_chunks() -> None:
    x = torch.zeros(2, 2 * CHUNK + 9, device=DEVICE)
    x[0, [CHUNK + 3, 5, 2 * CHUNK + 1]] = 7.0
    x[1, [2 * CHUNK + 8, CHUNK]] = 7.0
    assert argmax(x).tolist() == [5, CHUNK]


def test_argmax_of_strided_rows_and_no_rows() -> None:
    wide = torch.randn(3, 2 * CHUNK, device=DEVICE)
    rows = wide[:, :CHUNK + 10]
    assert torch.equal(argmax(rows), rows.argmax(dim=-1))
    assert argmax(torch.empty(0, 50, device=DEVICE)).shape == (0,)
