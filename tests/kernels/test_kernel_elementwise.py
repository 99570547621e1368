import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, assert_close, poison_next_alloc
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

from pagedserve.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from pagedserve.kernels.norm import rms_norm
from pagedserve.kernels.reference import gelu_tanh_and_mul_ref, rms_norm_ref, silu_and_mul_ref

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


def test_rms_norm_writes_the_first_rows_of_a_given_buffer() -> None:
    x, residual = torch.randn(3, 96, device=DEVICE), torch.randn(3, 96, device=DEVICE)
    weight = torch.randn(96, device=DEVICE)
    buffer = torch.full((8, 96), 7.0, device=DEVICE)
    out, summed = rms_norm(x, weight, 1e-5, residual, buffer[:3])
    ref, ref_sum = rms_norm_ref(x, weight, 1e-5, residual)
    assert out.data_ptr() == buffer.data_ptr()
    assert_close(buffer[:3], ref)
    torch.testing.assert_close(summed, ref_sum)
    assert torch.all(buffer[3:] == 7.0)


def test_gemma_rms_norm_is_a_float32_weight_plus_one() -> None:
    """Gemma's RMSNorm scales by (1 + weight) in fp32: the loader adds 1 to the weight and keeps
    it in fp32 (bf16 would round 1 + w to 8 bits), and the plain kernel matches transformers."""
    x = torch.randn(4, 96, dtype=torch.bfloat16, device=DEVICE) * 3
    gemma = Gemma2RMSNorm(96, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        gemma.weight.copy_(torch.randn(96).to(torch.bfloat16))
    out, _ = rms_norm(x, 1.0 + gemma.weight.float(), 1e-6)
    torch.testing.assert_close(out, gemma(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [80, 2048])
@pytest.mark.parametrize("kernel, ref", [(silu_and_mul, silu_and_mul_ref),
                                         (gelu_tanh_and_mul, gelu_tanh_and_mul_ref)],
                         ids=["silu", "gelu_tanh"])
def test_gated_activation(kernel, ref, dtype: torch.dtype, d: int) -> None:
    x = torch.randn(3, 2, 2 * d, dtype=dtype, device=DEVICE) * 4
    poison_next_alloc((6, d), dtype)
    out = kernel(x)
    assert_close(out, ref(x))


@pytest.mark.parametrize("kernel, ref", [(silu_and_mul, silu_and_mul_ref),
                                         (gelu_tanh_and_mul, gelu_tanh_and_mul_ref)],
                         ids=["silu", "gelu_tanh"])
def test_gated_activation_writes_the_first_rows_of_a_given_buffer(kernel, ref) -> None:
    x = torch.randn(3, 2 * 80, device=DEVICE) * 4
    buffer = torch.full((8, 80), 7.0, device=DEVICE)
    assert kernel(x, buffer[:3]).data_ptr() == buffer.data_ptr()
    assert_close(buffer[:3], ref(x))
    assert torch.all(buffer[3:] == 7.0)


@pytest.mark.parametrize("rows", [3, 300])
@pytest.mark.parametrize("kernel, ref", [(silu_and_mul, silu_and_mul_ref),
                                         (gelu_tanh_and_mul, gelu_tanh_and_mul_ref)],
                         ids=["silu", "gelu_tanh"])
def test_gated_activation_scaled_by_a_folded_norm(kernel, ref, rows: int) -> None:
    """norm_of=(stream, eps): gate and up scaled by each row's 1 / RMS(stream) first; past
    NORMED_WIDE_ROWS rows in wider programs."""
    x = torch.randn(rows, 2 * 1500, device=DEVICE) * 4
    stream = torch.randn(rows, 96, device=DEVICE) * torch.linspace(0.1, 30, rows, device=DEVICE)[:, None]
    inv = torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert_close(kernel(x, norm_of=(stream, 1e-5)), ref(x * inv))
