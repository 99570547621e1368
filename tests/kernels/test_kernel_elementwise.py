import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, assert_close, poison_next_alloc
from pagedserve.kernels.activation import silu_and_mul
from pagedserve.kernels.norm import rms_norm
from pagedserve.kernels.reference import rms_norm_ref, silu_and_mul_ref

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 256])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    x = torch.randn(2, 3, hidden, dtype=dtype, device=DEVICE) * 3
    weight = torch.randn(hidden, dtype=dtype, device=DEVICE)
    residual = torch.randn_like(x) if with_residual else None
    x_before = x.clone()
    poison_next_alloc(x.shape, dtype)
    out, summed = rms_norm(x, weight, 1e-5, residual)
    ref, ref_sum = rms_norm_ref(x, weight, 1e-5, residual)
    assert_close(out, ref)
    assert torch.equal(x, x_before)
    if with_residual:
        # The interpreter rounds fp32 -> bf16 differently from torch: allow the dtype's rounding.
        torch.testing.assert_close(summed, ref_sum)
    else:
        assert summed is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [80, 2048])
def test_silu_and_mul(dtype: torch.dtype, d: int) -> None:
    x = torch.randn(3, 2, 2 * d, dtype=dtype, device=DEVICE) * 4
    poison_next_alloc((6, d), dtype)
    out = silu_and_mul(x)
    assert_close(out, silu_and_mul_ref(x))
