"""Neox-style (rotate-half) rotary position embedding."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x, token, stride_t, stride_h, num_heads, cos, sin,
                  HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HALF)[None, :]
    mask = offs_h < num_heads
    lo_ptrs = x + token * stride_t + offs_h * stride_h + offs_d
    x1 = tl.load(lo_ptrs, mask=mask).to(tl.float32)
    x2 = tl.load(lo_ptrs + HALF, mask=mask).to(tl.float32)
    tl.store(lo_ptrs, (x1 * cos - x2 * sin).to(x.dtype.element_ty), mask=mask)
    tl.store(lo_ptrs + HALF, (x2 * cos + x1 * sin).to(x.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(positions, q, k, cos_sin_cache, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_cache, num_heads, num_kv_heads, Q_HEADS_PAD: tl.constexpr,
                   K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + token).to(tl.int64)
    offs_d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_cache + pos * stride_cache + offs_d).to(tl.float32)
    sin = tl.load(cos_sin_cache + pos * stride_cache + HALF + offs_d).to(tl.float32)
    _rotate_heads(q, token, stride_qt, stride_qh, num_heads, cos, sin, Q_HEADS_PAD, HALF)
    _rotate_heads(k, token, stride_kt, stride_kh, num_kv_heads, cos, sin, K_HEADS_PAD, HALF)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] IN PLACE by their
    positions [T]; cos_sin_cache [max_positions, head_dim] holds cos then sin halves.

    Returns (q, k), the same tensors, with the values of `rotary_ref`. q and k may be strided
    views (e.g. of a fused qkv output) whose last dim is contiguous; head_dim a power of two.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos_sin_cache.stride(0), num_heads, num_kv_heads,
            Q_HEADS_PAD=triton.next_power_of_2(num_heads),
            K_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HALF=head_dim // 2)
    return q, k
