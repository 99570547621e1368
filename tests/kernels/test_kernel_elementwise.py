import pytest
import torch

from kernel_testing import DEVICE, assert_close, poison_next_alloc
from kernels.activation import silu_and_mul
from kernels.norm import rms_norm
from kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref
from kernels.rotary import rotary

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
def test_rotary_in_place_on_qkv_views(dtype: torch.dtype) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 7, 8, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype,
                      device=DEVICE)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    cos_sin_cache = torch.randn(50, head_dim, device=DEVICE)
    positions = torch.randint(0, 50, (num_tokens,), device=DEVICE)
    ref_q, ref_k = rotary_ref(positions, q.clone(), k.clone(), cos_sin_cache)
    got_q, got_k = rotary(positions, q, k, cos_sin_cache)
    assert got_q is q and got_k is k
    assert_close(q, ref_q)
    assert_close(k, ref_k)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [80, 2048])
def test_silu_and_mul(dtype: torch.dtype, d: int) -> None:
    x = torch.randn(3, 2, 2 * d, dtype=dtype, device=DEVICE) * 4
    poison_next_alloc((6, d), dtype)
    out = silu_and_mul(x)
    assert_close(out, silu_and_mul_ref(x))
