import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, rel_err
from pagedserve.kernels.activation import gelu_tanh_and_mul_quant_fp8, silu_and_mul_quant_fp8
from pagedserve.kernels.norm import rms_norm_quant_fp8
from pagedserve.kernels.quant import per_token_quant_fp8
from pagedserve.kernels.reference import (FP8_MAX, gelu_tanh_and_mul_quant_fp8_ref,
                                          per_token_quant_fp8_ref, rms_norm_quant_fp8_ref,
                                          silu_and_mul_quant_fp8_ref)


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


def dequantized(quantized: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    q, scale = quantized
    return q.float() * scale


def assert_quantized_like(out: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert out[0].dtype == torch.float8_e4m3fn and out[1].shape == ref[1].shape
    # Not bit for bit: the interpreter rounds fp32 -> bf16 differently from torch, and a GPU
    # sums a row in another order, which moves a scale by an ulp and some values by one FP8 step
    # (2**-3 relative at most). Within FP8's rounding of the unfused pair, then.
    torch.testing.assert_close(out[1], ref[1], rtol=1e-2, atol=0)
    assert rel_err(dequantized(out), dequantized(ref)) < 2**-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_matches_norm_then_quant(dtype: torch.dtype, with_residual: bool) -> None:
    x = (torch.randn(6, 96, device=DEVICE) * 3).to(dtype)
    weight = torch.randn(96, device=DEVICE).to(dtype)
    residual = torch.randn_like(x) if with_residual else None
    out, summed = rms_norm_quant_fp8(x, weight, 1e-5, residual)
    ref, ref_sum = rms_norm_quant_fp8_ref(x, weight, 1e-5, residual)
    assert_quantized_like(out, ref)
    if with_residual:
        torch.testing.assert_close(summed, ref_sum)
    else:
        assert summed is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [80, 2500])
@pytest.mark.parametrize("kernel, ref", [
    (silu_and_mul_quant_fp8, silu_and_mul_quant_fp8_ref),
    (gelu_tanh_and_mul_quant_fp8, gelu_tanh_and_mul_quant_fp8_ref)], ids=["silu", "gelu_tanh"])
def test_gated_activation_quant_matches_activation_then_quant(kernel, ref, dtype: torch.dtype,
                                                              d: int) -> None:
    x = (torch.randn(5, 2 * d, device=DEVICE) * 4).to(dtype)
    assert_quantized_like(kernel(x), ref(x))
