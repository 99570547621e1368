import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, assert_close
from pagedserve.kernels.fp8_matmul import MID_BATCH, SMALL_BATCH, w8a8_matmul, w8a16_matmul
from pagedserve.kernels.reference import per_token_quant_fp8_ref


# The CPU interpreter's tl.dot on bf16 is wrong, so float32 activations there.
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, SMALL_BATCH])
@pytest.mark.parametrize("bias", [False, True])
# N and K off the tile sizes, so the masks are exercised; then K a multiple of the GEMV's step.
@pytest.mark.parametrize("n, k", [(72, 1100), (40, 2048)])
def test_w8a16_matches_the_dequantized_matmul(dtype: torch.dtype, num_tokens: int, bias: bool,
                                              n: int, k: int) -> None:
    weight, weight_scale = per_token_quant_fp8_ref(torch.randn(n, k, device=DEVICE) * 0.05)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    x = torch.randn(num_tokens, k, device=DEVICE).to(dtype)
    ref = x.float() @ (weight.float() * weight_scale).t() + (0 if b is None else b.float())
    assert_close(w8a16_matmul(x, weight.to(DEVICE), weight_scale.to(DEVICE), b), ref.to(dtype))


def test_no_tokens_gives_an_empty_output() -> None:
    weight, weight_scale = per_token_quant_fp8_ref(torch.randn(16, 64, device=DEVICE))
    assert w8a16_matmul(torch.empty(0, 64, device=DEVICE), weight, weight_scale).shape == (0, 16)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [SMALL_BATCH + 1, 40, MID_BATCH, MID_BATCH + 37])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n, k", [(72, 1100), (40, 2048)])
def test_w8a8_matches_the_dequantized_matmul(out_dtype: torch.dtype, num_tokens: int, bias: bool, n: int,
                                             k: int) -> None:
    weight, weight_scale = per_token_quant_fp8_ref(torch.randn(n, k, device=DEVICE) * 0.05)
    # Rows of a wider buffer, as a kernel before may leave them.
    q, q_scale = per_token_quant_fp8_ref(torch.randn(num_tokens, k + 64, device=DEVICE))
    q = q[:, :k]
    b = torch.randn(n, device=DEVICE).to(torch.bfloat16) if bias else None
    ref = (q.float() * q_scale) @ (weight.float() * weight_scale).t() + (0 if b is None else b.float())
    out = w8a8_matmul(q, q_scale, weight, weight_scale, b, out_dtype)
    assert out.dtype == out_dtype
    assert_close(out, ref.to(out_dtype))


def test_w8a8_no_tokens_gives_an_empty_output() -> None:
    weight, weight_scale = per_token_quant_fp8_ref(torch.randn(16, 64, device=DEVICE))
    q, q_scale = per_token_quant_fp8_ref(torch.empty(0, 64, device=DEVICE))
    assert w8a8_matmul(q, q_scale, weight, weight_scale, None, torch.bfloat16).shape == (0, 16)
