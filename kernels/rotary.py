"""Neox-style (rotate-half) rotary position embedding fused with the write of new keys and values
into the paged KV cache: one launch per layer instead of two. An fp8 cache is written as
x / scale saturated to +-448 (see kernels/reference.py)."""
import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.norm import inv_rms
from pagedserve.kernels.reference import FP8_MAX, is_fp8

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _load_cos_sin(positions, token, cos_sin_cache, stride_cache, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    pos = tl.load(positions + token).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)[None, :]
    mask = offs_d < HALF
    cos = tl.load(cos_sin_cache + pos * stride_cache + offs_d, mask=mask).to(tl.float32)
    sin = tl.load(cos_sin_cache + pos * stride_cache + HALF + offs_d, mask=mask).to(tl.float32)
    return cos, sin


@triton.jit
def _to_storage(x, scale, dst, FP8: tl.constexpr):
    """x as dst stores it: divided by the scale and saturated for an fp8 dst."""
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -_FP8_MAX), _FP8_MAX)
    return x.to(dst.dtype.element_ty)


@triton.jit
def _head_tile(base, stride_h, num_heads, HEADS_PAD: tl.constexpr, WIDTH: tl.constexpr,
               WIDTH_PAD: tl.constexpr):
    """Pointers to the first WIDTH elements of each of one token's heads at base, as a
    [HEADS_PAD, WIDTH_PAD] tile (powers of two), and the mask of the elements that exist."""
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, WIDTH_PAD)[None, :]
    mask = offs_h < num_heads
    if WIDTH_PAD != WIDTH:
        # Only where needed: a mask along the row stops vectorized loads.
        mask = mask & (offs_d < WIDTH)
    return base + offs_h * stride_h + offs_d, mask


@triton.jit
def _load_halves(src, stride_sh, num_heads, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                 HALF_PAD: tl.constexpr):
    """One token's heads at src: their rotary dims' low and high halves in fp32, and the mask of
    the elements that exist."""
    src_lo, mask = _head_tile(src, stride_sh, num_heads, HEADS_PAD, HALF, HALF_PAD)
    x1 = tl.load(src_lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_lo + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1, x2, mask


@triton.jit
def _rotated(x1, x2, mask, num_heads, cos, sin, bias, norm_weight, norm_eps, scale,
             DTYPE: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
             HALF_PAD: tl.constexpr, BIASED: tl.constexpr, HEAD_NORM: tl.constexpr):
    """Heads' halves (see _load_halves) rotated; with BIASED each head first scaled by `scale`
    and its bias (whole heads at `bias`) added, with HEAD_NORM then RMS-normed (see
    _head_normed)."""
    if BIASED:
        x1, x2 = _biased(x1, x2, bias, mask, scale, num_heads, HEADS_PAD, HALF, HALF_PAD)
        scale = 1.0
    if HEAD_NORM:
        x1, x2 = _head_normed(x1, x2, norm_weight, norm_eps, scale, DTYPE, HALF, HALF_PAD)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _head_normed(x1, x2, weight, eps, scale, DTYPE: tl.constexpr, HALF: tl.constexpr,
                 HALF_PAD: tl.constexpr):
    """The q/k norm (RMS over each head, with that eps, times weight) of heads' halves [heads,
    HALF_PAD] scaled by `scale` (a folded input norm's 1 / RMS, else 1), rounded to DTYPE as the
    norm kernel's output was before rotary read it: GPU greedy tokens of a bf16 Qwen3-MoE fell
    below the parity test's agreement with transformers (0.945 < 0.95) when it stayed fp32."""
    mean_square = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) * (scale * scale) / (2 * HALF)
    r = (scale * tl.rsqrt(mean_square + eps))[:, None]
    offs = tl.arange(0, HALF_PAD)[None, :]
    w1 = tl.load(weight + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(weight + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    return (x1 * r * w1).to(DTYPE).to(tl.float32), (x2 * r * w2).to(DTYPE).to(tl.float32)


@triton.jit
def _biased(x1, x2, bias, mask, scale, num_heads, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
            HALF_PAD: tl.constexpr):
    """Heads' halves [heads, HALF_PAD] times scale plus their bias: a projection's bias kept out
    of its folded GEMM goes on after the folded norm's 1 / RMS, as it went on after the norm."""
    bias_lo, _ = _head_tile(bias, 2 * HALF, num_heads, HEADS_PAD, HALF, HALF_PAD)
    b1 = tl.load(bias_lo, mask=mask, other=0.0).to(tl.float32)
    b2 = tl.load(bias_lo + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * scale + b1, x2 * scale + b2


@triton.jit
def _store_halves(dst, stride_dh, num_heads, lo, hi, scale, HEADS_PAD: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, FP8: tl.constexpr):
    """Stores rotated heads at dst, in dst's storage (see _to_storage)."""
    dst_lo, mask = _head_tile(dst, stride_dh, num_heads, HEADS_PAD, HALF, HALF_PAD)
    tl.store(dst_lo, _to_storage(lo, scale, dst, FP8), mask=mask)
    tl.store(dst_lo + HALF, _to_storage(hi, scale, dst, FP8), mask=mask)


@triton.jit
def _cache_entry(cache, slot, stride_block, stride_slot, BLOCK_SIZE: tl.constexpr):
    """Pointer to the [num_kv_heads, head_dim] entry of `slot` in a paged cache."""
    return cache + (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot


@triton.jit
def _tail(src, stride_sh, num_heads, scale, HEADS_PAD: tl.constexpr, WIDTH: tl.constexpr,
          WIDTH_PAD: tl.constexpr, NORMED: tl.constexpr):
    """The first WIDTH elements of one token's heads at src (partial rotary's unrotated dims) and
    their mask; with NORMED scaled by `scale` (a folded norm's 1 / RMS), in place too."""
    heads, mask = _head_tile(src, stride_sh, num_heads, HEADS_PAD, WIDTH, WIDTH_PAD)
    x = tl.load(heads, mask=mask)
    if NORMED:
        x = _scaled_in_place(x, heads, mask, scale, heads, False)
    return x, mask


@triton.jit
def _scaled_in_place(x, heads, mask, scale, bias, BIASED: tl.constexpr):
    """x, loaded from the tile `heads`, times `scale` plus (BIASED) the same tile of `bias`, in
    heads' dtype, stored back there too: prefill attention reads the step's keys and values from
    k and v."""
    y = x.to(tl.float32) * scale
    if BIASED:
        y += tl.load(bias, mask=mask).to(tl.float32)
    y = y.to(heads.dtype.element_ty)
    tl.store(heads, y, mask=mask)
    return y


@triton.jit
def _rotary_write_kv_kernel(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                            k_scale_ptr, v_scale_ptr, x, q_bias, k_bias, v_bias, q_norm,
                            k_norm, qk_eps, stride_qt, stride_qh, stride_kt, stride_kh,
                            stride_vt, stride_vh, stride_x, stride_cache, stride_kcb,
                            stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                            num_heads, num_kv_heads, hidden, eps, BLOCK_SIZE: tl.constexpr,
                            Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
                            HALF: tl.constexpr,
                            HALF_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HEAD_PAD: tl.constexpr, TAIL_PAD: tl.constexpr, FP8: tl.constexpr,
                            KV_SCALED: tl.constexpr, NORMED: tl.constexpr,
                            HIDDEN_PAD: tl.constexpr, BIASED: tl.constexpr,
                            HEAD_NORM: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    # Positions, slots and the cos/sin cache were uploaded before the step's first kernel:
    # read before the wait (see kernels/pdl.py).
    cos, sin = _load_cos_sin(positions, token, cos_sin_cache, stride_cache, HALF, HALF_PAD)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    pdl.wait_for_previous(PDL)
    # Every load before the stream row's sum, whose barrier would hold back loads after it.
    q_token = q + token * stride_qt
    q1, q2, q_mask = _load_halves(q_token, stride_qh, num_heads, Q_HEADS_PAD, HALF, HALF_PAD)
    k_token = k + token * stride_kt
    k1, k2, k_mask = _load_halves(k_token, stride_kh, num_kv_heads, K_HEADS_PAD, HALF, HALF_PAD)
    v_heads, v_mask = _head_tile(v + token * stride_vt, stride_vh, num_kv_heads, K_HEADS_PAD,
                                 HEAD_DIM, HEAD_PAD)
    v_token = tl.load(v_heads, mask=v_mask)
    inv = 1.0
    if NORMED:
        inv = inv_rms(x + token * stride_x, hidden, eps, HIDDEN_PAD)
        if not HEAD_NORM and not BIASED:
            # Rotation is linear: scaling the rotated halves is scaling the projection's input.
            cos = cos * inv
            sin = sin * inv
    q_lo, q_hi = _rotated(q1, q2, q_mask, num_heads, cos, sin, q_bias, q_norm, qk_eps, inv,
                          q.dtype.element_ty, Q_HEADS_PAD, HALF, HALF_PAD, BIASED, HEAD_NORM)
    _store_halves(q_token, stride_qh, num_heads, q_lo, q_hi, 1.0, Q_HEADS_PAD, HALF, HALF_PAD,
                  False)
    # The rotated k also goes back to k: prefill attention reads the step's keys from there.
    k_lo, k_hi = _rotated(k1, k2, k_mask, num_kv_heads, cos, sin, k_bias, k_norm, qk_eps, inv,
                          k.dtype.element_ty, K_HEADS_PAD, HALF, HALF_PAD, BIASED, HEAD_NORM)
    _store_halves(k_token, stride_kh, num_kv_heads, k_lo, k_hi, 1.0, K_HEADS_PAD, HALF, HALF_PAD,
                  False)
    if TAIL_PAD > 0:
        # Partial rotary: the dims past the rotary ones pass through, scaled by a folded norm.
        if NORMED:
            _tail(q_token + 2 * HALF, stride_qh, num_heads, inv, Q_HEADS_PAD, HEAD_DIM - 2 * HALF,
                  TAIL_PAD, NORMED)
        k_tail, k_tail_mask = _tail(k_token + 2 * HALF, stride_kh, num_kv_heads, inv, K_HEADS_PAD,
                                    HEAD_DIM - 2 * HALF, TAIL_PAD, NORMED)
    if NORMED or BIASED:
        v_bias_heads, _ = _head_tile(v_bias, HEAD_DIM, num_kv_heads, K_HEADS_PAD, HEAD_DIM,
                                     HEAD_PAD)
        v_token = _scaled_in_place(v_token, v_heads, v_mask, inv, v_bias_heads, BIASED)
    # Slot -1 marks a CUDA-graph padding token: it owns no cache slot.
    if slot < 0:
        return
    k_scale = 1.0
    v_scale = 1.0
    if KV_SCALED:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    k_entry = _cache_entry(k_cache, slot, stride_kcb, stride_kcs, BLOCK_SIZE)
    _store_halves(k_entry, stride_kch, num_kv_heads, k_lo, k_hi, k_scale, K_HEADS_PAD, HALF,
                  HALF_PAD, FP8)
    if TAIL_PAD > 0:
        tail_entry, _ = _head_tile(k_entry + 2 * HALF, stride_kch, num_kv_heads, K_HEADS_PAD,
                                   HEAD_DIM - 2 * HALF, TAIL_PAD)
        tl.store(tail_entry, _to_storage(k_tail, k_scale, k_cache, FP8), mask=k_tail_mask)
    v_entry, _ = _head_tile(_cache_entry(v_cache, slot, stride_vcb, stride_vcs, BLOCK_SIZE),
                            stride_vch, num_kv_heads, K_HEADS_PAD, HEAD_DIM, HEAD_PAD)
    tl.store(v_entry, _to_storage(v_token, v_scale, v_cache, FP8), mask=v_mask)


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor,
                    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    norm_of: tuple[torch.Tensor, float] | None = None,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """`rotary_ref` then `write_kv_ref` in one kernel launch: rotates q [T, num_heads, head_dim]
    and k IN PLACE by positions [T] (cos_sin_cache [max_positions, rotary_dim] holds cos then sin
    halves; only the first rotary_dim dims of each head rotate), and writes the rotated k and v
    [T, num_kv_heads, head_dim] to their slots of the paged caches [num_blocks, block_size,
    num_kv_heads, head_dim], skipping tokens with slot -1 (CUDA-graph padding). An fp8 cache
    stores k / k_scale and v / v_scale (kv_scales: float32 [] tensors; none means 1.0),
    saturated to +-448; other caches ignore kv_scales.

    norm_of=(x, eps), for a projection whose input RMSNorm was folded into its weights
    (layers/decoder.py's fold_norms): q, k and v are first scaled per token by 1 / RMS(x[t])
    with that norm's eps (x [T, hidden], rows contiguous), v IN PLACE too.
    qk_norm=(q_weight, k_weight, eps): q's and k's heads are RMS-normed over head_dim (Qwen3's
    q_norm and k_norm) before they rotate, after norm_of's scale; heads must rotate whole.
    bias=(q_bias, k_bias, v_bias), contiguous [heads * head_dim] each, for a projection whose bias
    was kept out of its folded GEMM (Qwen2's qkv): added to q, k and v (IN PLACE) after norm_of's
    scale and before the q/k norms; heads must rotate whole.

    Returns q. Without norm_of or bias v is only read. q, k and v may be strided views (of the
    fused qkv output) whose last dim is contiguous.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    tail = head_dim - 2 * half
    fp8 = is_fp8(k_cache)
    scaled = fp8 and kv_scales is not None
    k_scale, v_scale = kv_scales if scaled else (None, None)
    if (qk_norm is not None or bias is not None) and tail:
        raise ValueError("rotary_write_kv applies a bias or q/k norms only where heads rotate "
                         "whole")
    x, eps = norm_of if norm_of is not None else (q, 0.0)
    q_norm, k_norm, qk_eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    q_bias, k_bias, v_bias = bias if bias is not None else (q, q, q)
    if num_tokens > 0:
        _rotary_write_kv_kernel[(num_tokens,)](
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale, x,
            q_bias, k_bias, v_bias, q_norm, k_norm, qk_eps, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), x.stride(0),
            cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), num_heads, num_kv_heads,
            x.shape[-1], eps,
            BLOCK_SIZE=k_cache.shape[1], Q_HEADS_PAD=triton.next_power_of_2(num_heads),
            K_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HALF=half,
            HALF_PAD=triton.next_power_of_2(half), HEAD_DIM=head_dim,
            HEAD_PAD=triton.next_power_of_2(head_dim),
            TAIL_PAD=triton.next_power_of_2(tail) if tail else 0, FP8=fp8, KV_SCALED=scaled,
            NORMED=norm_of is not None, HIDDEN_PAD=triton.next_power_of_2(x.shape[-1]),
            BIASED=bias is not None, HEAD_NORM=qk_norm is not None, **pdl.launch_args(q.device))
    return q
