import pytest
import torch

from tests.kernels.kernel_testing import DEVICE
from pagedserve.kernels.quant import per_token_quant_fp8
from pagedserve.kernels.reference import FP8_MAX, per_token_quant_fp8_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576, 5000])
def test_per_token_quant_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    # Rows of very different magnitudes, one all zero: each gets a scale of its own.
    x = torch.randn(5, hidden, device=DEVICE) * torch.tensor([[1e-3], [0.1], [1.0], [30.0], [0.0]],
                                                              device=DEVICE)
    x = x.to(dtype)
    q, scale = per_token_quant_fp8(x)
    ref_q, ref_scale = per_token_quant_fp8_ref(x)
    assert q.dtype == ref_q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), ref_q.float())


def test_reference_round_trip_and_saturation() -> None:
    x = torch.randn(4, 256) * 5
    x[1, 7] = 1e4
    q, scale = per_token_quant_fp8_ref(x)
    # A row's largest magnitude maps to 448; E4M3 keeps 3 mantissa bits: relative error <= 2**-4.
    assert q[1].float().abs().max() == FP8_MAX
    assert q.float().abs().max() <= FP8_MAX
    big = x.abs() > 0.1 * scale * FP8_MAX
    assert ((q.float() * scale - x).abs() <= x.abs() * 2**-4)[big].all()
    zero_q, zero_scale = per_token_quant_fp8_ref(torch.zeros(2, 32))
    assert (zero_q.float() == 0).all() and (zero_scale > 0).all()
