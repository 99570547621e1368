"""Scatter of new keys and values into the paged KV cache."""
import torch
import triton
import triton.language as tl


@triton.jit
def _cache_entry(cache, slot, stride_block, stride_slot, BLOCK_SIZE: tl.constexpr):
    """Pointer to the [num_kv_heads, head_dim] entry of `slot` in a paged cache."""
    return cache + (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot


@triton.jit
def _copy_heads(src, stride_sh, dst, stride_dh, num_heads, HEADS_PAD: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """Copies one token's heads from src to dst, converted to dst's dtype."""
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    mask = offs_h < num_heads
    x = tl.load(src + offs_h * stride_sh + offs_d, mask=mask)
    tl.store(dst + offs_h * stride_dh + offs_d, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(key, value, k_cache, v_cache, slot_mapping, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
                     stride_vch, num_kv_heads, BLOCK_SIZE: tl.constexpr,
                     HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    # Slot -1 marks a CUDA-graph padding token: it owns no cache slot.
    if slot < 0:
        return
    _copy_heads(key + token * stride_kt, stride_kh,
                _cache_entry(k_cache, slot, stride_kcb, stride_kcs, BLOCK_SIZE), stride_kch,
                num_kv_heads, HEADS_PAD, HEAD_DIM)
    _copy_heads(value + token * stride_vt, stride_vh,
                _cache_entry(v_cache, slot, stride_vcb, stride_vcs, BLOCK_SIZE), stride_vch,
                num_kv_heads, HEADS_PAD, HEAD_DIM)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_dim] to their slots of the paged caches
    [num_blocks, block_size, num_kv_heads, head_dim]; tokens with slot -1 are skipped.

    Head dim must be a power of two and the last dim of every tensor contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1], HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim)
