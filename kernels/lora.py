"""LoRA deltas of a batch whose tokens use different adapters: out[m] += (x[m] @ a_s.T) @ b_s.T for
token m's slot s (none where its slot is -1), a_s [W, K] and b_s [N, W] slot s's blocks of every
slot's A and B stacked, a [S * W, K] and b [N, S * W] (executor_svc/lora.py's layout; reference:
kernels/reference.py's lora_delta_ref).

Two launches. The first reduces x @ a_s.T over K for each slot that a block of rows uses, in
`splits` programs per block and slot that each take a slice of K and add their float32 sums
atomically (so their order, and the last bits, vary from run to run, as in vLLM's LoRA kernels).
The second keeps each row's own slot of those sums and adds the product with that slot's B into
the output. A slot that no row of a block uses is neither read nor multiplied there.

The torch form it replaces on a GPU (lora_delta_ref: x @ a.T for every slot, a mask, an addmm)
gives cuBLAS a GEMM of a few dozen columns over all of K, which it tiles into few programs (not
profiled). On an H100 (Llama-3.1-8B shape, rank 16, the four projections of 32
layers in one CUDA graph, 2026-12-06) this took 25.2 / 30.8 / 34.3 / 38.7 us a layer for 1 / 16 /
32 / 64 rows of one adapter against 38.7 / 42.6 / 44.8 / 46.7; with four adapters mixed in every
block of rows, 46.7 against 46.4 at 16 rows and 96.4 against 69.2 at 256 (BENCHMARKS.md)."""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.quant import INTERPRETED

BLOCK_N = 128
# A slice of K's tiles, x [BLOCK_M, BLOCK_K] and a_s [BLOCK_K, W], a few stages deep within the
# multiprocessor's 227 KB of shared memory at every rank (256 columns overran it at 64 x 128).
TILE_ELEMENTS = 16384
# A block's float32 sums [BLOCK_M, W] within 64 registers a thread of its 4 warps.
ACC_ELEMENTS = 8192
# Up to 32 slices of K for a decode step's rows, fewer as the row blocks grow (a prompt chunk's
# rows fill the device without them).
MAX_PROGRAMS = 256
MAX_SPLITS = 32


@triton.jit
def _product(a, b, PRECISION: tl.constexpr):
    # The interpreter's bf16 dot is wrong (kernels/fused_moe.py's _dot): float32 there.
    if PRECISION == "interpreted":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _uses(slot, s):
    return tl.max(tl.where(slot == s, 1, 0), axis=0) > 0


@triton.jit(do_not_specialize=["rows"])
def _shrink_kernel(x, a, slots, sums, rows, k, width, num_slots, stride_x, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, WIDTH_PAD: tl.constexpr,
                   PRECISION: tl.constexpr):
    block, split, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots + offs_m, mask=offs_m < rows, other=-1)
    if _uses(slot, s):
        offs_w = tl.arange(0, WIDTH_PAD)
        acc = tl.zeros((BLOCK_M, WIDTH_PAD), dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            offs_k = split * k_per_split + k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :],
                         mask=(offs_m[:, None] < rows) & (offs_k[None, :] < k), other=0.0)
            at = tl.load(a + (s * width + offs_w[None, :]).to(tl.int64) * k + offs_k[:, None],
                         mask=(offs_w[None, :] < width) & (offs_k[:, None] < k), other=0.0)
            acc += _product(xt, at, PRECISION)
        rows_at = (block * num_slots + s) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.atomic_add(sums + rows_at[:, None] * WIDTH_PAD + offs_w[None, :], acc, sem="relaxed")


@triton.jit(do_not_specialize=["rows"])
def _expand_kernel(sums, b, slots, out, rows, n, width, num_slots, stride_b, stride_out,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH_PAD: tl.constexpr,
                   PRECISION: tl.constexpr):
    block, col_block = tl.program_id(0), tl.program_id(1)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots + offs_m, mask=offs_m < rows, other=-1)
    # A block of base-model rows (or padding) adds nothing.
    if tl.max(slot, axis=0) >= 0:
        offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_w = tl.arange(0, WIDTH_PAD)
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(num_slots):
            if _uses(slot, s):
                rows_at = (block * num_slots + s) * BLOCK_M + tl.arange(0, BLOCK_M)
                h = tl.load(sums + rows_at[:, None] * WIDTH_PAD + offs_w[None, :])
                h = tl.where(slot[:, None] == s, h, 0.0).to(b.dtype.element_ty)
                bt = tl.load(b + offs_n[None, :].to(tl.int64) * stride_b + s * width + offs_w[:, None],
                             mask=(offs_n[None, :] < n) & (offs_w[:, None] < width), other=0.0)
                delta += _product(h, bt, PRECISION)
        where = out + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
        mask = (offs_m[:, None] < rows) & (offs_n[None, :] < n)
        current = tl.load(where, mask=mask, other=0.0)
        tl.store(where, (current.to(tl.float32) + delta).to(current.dtype), mask=mask)


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """out [M, N] += each row's LoRA delta, in place (x [M, K], a [S * W, K], b [N, S * W], slots
    [>= M] int64, -1 for none; rows of x and out contiguous in their last dim)."""
    rows, k = x.shape
    width = a.shape[0] // num_slots
    t = tiling(rows, k, width)
    blocks = triton.cdiv(rows, t.block_m)
    sums = torch.zeros(blocks * num_slots * t.block_m, t.width_pad, dtype=torch.float32, device=x.device)
    # float32 models get float32 products, as torch's matmul gives them (TF32 off).
    precision = "interpreted" if INTERPRETED else "ieee" if x.dtype == torch.float32 else "tf32"
    _shrink_kernel[(blocks, triton.cdiv(k, t.k_per_split), num_slots)](
        x, a, slots, sums, rows, k, width, num_slots, x.stride(0), t.k_per_split,
        BLOCK_M=t.block_m, BLOCK_K=t.block_k, WIDTH_PAD=t.width_pad, PRECISION=precision)
    n = b.shape[0]
    _expand_kernel[(blocks, triton.cdiv(n, BLOCK_N))](
        sums, b, slots, out, rows, n, width, num_slots, b.stride(0), out.stride(0),
        BLOCK_M=t.block_m, BLOCK_N=BLOCK_N, WIDTH_PAD=t.width_pad, PRECISION=precision)
    return out


@dataclass(slots=True, frozen=True)
class Tiling:
    block_m: int
    block_k: int
    width_pad: int
    k_per_split: int  # a multiple of block_k


@functools.cache
def tiling(rows: int, k: int, width: int) -> Tiling:
    width_pad = max(16, triton.next_power_of_2(width))
    block_m = min(64, ACC_ELEMENTS // width_pad, max(16, triton.next_power_of_2(rows)))
    block_k = max(16, min(128, TILE_ELEMENTS // width_pad))
    tiles = triton.cdiv(k, block_k)
    splits = max(1, min(MAX_SPLITS, tiles, MAX_PROGRAMS // triton.cdiv(rows, block_m)))
    return Tiling(block_m, block_k, width_pad, block_k * triton.cdiv(tiles, splits))
