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


def test_argmax_with_noise_is_argmax_of_logits_minus_log_noise() -> None:
    logits = torch.randn(4, 3 * CHUNK + 5, device=DEVICE)
    noise = torch.empty_like(logits).exponential_()
    assert torch.equal(argmax(logits, noise), (logits - noise.log()).argmax(dim=-1))


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
