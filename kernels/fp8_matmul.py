"""x @ W.T for FP8 E4M3 weights with a float32 scale per output channel: activations kept in their
own dtype (W8A16), the path for small batches, which are bound by reading the weights; and
activations quantized per token (W8A8) for the mid batches of decode steps.

Measured on an H200 (Llama-3.1-8B projections, one decoder layer's four GEMMs, CUDA graphs): at
one token 72 us here against 118 us for the bf16 GEMMs and 124 us for torch._scaled_mm with
row-wise scales plus the activation quantization it needs; at 2-16 tokens 96 us against 113.
With every layer's weights cold in L2, as in a decode step, one token takes 74 us a layer."""
import functools

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl

# Up to this many tokens the weight read dominates and W8A16 wins; past it W8A8 GEMMs do.
SMALL_BATCH = 16
# Up to this many the W8A8 GEMM below beats cuBLASLt's row-wise _scaled_mm, whose 128 x 128 tiles
# leave most multiprocessors idle on a layer's narrow projections. On an H100 (Llama-3.1-8B shape,
# 8 distinct weights in one CUDA graph, us a GEMM at 48 / 64 rows): qkv 13.9 / 14.0 against 12.3 /
# 12.4, o_proj 13.4 / 13.3 against 9.8 / 9.8, gate_up 49.8 / 50.3 against 44.6 / 45.2, down_proj
# 35.8 / 35.9 against 26.0 / 26.3. At 128 rows gate_up lost (48.5 against 49.9). One 64-row tile
# serves every row count up to it: 32-row tiles run Hopper's older MMA and lost to cuBLASLt on qkv
# (14.6 against 14.1 us at 32 rows).
MID_BATCH = 64
MID_BLOCK_K = 256
# Narrow projections (N <= 4,096: a Llama-3.1-8B layer's o_proj and down_proj, to which cuBLASLt's
# 128-column tiles give 32 thread blocks) keep the W8A8 GEMM up to this many rows, in 64-row tiles.
# On an H100 the best tilings at 128 rows took o_proj 11.0 us against 13.4, down_proj 30.1 against
# 36.3, where qkv tied and gate_up lost; with this one the FP8 + FP8 KV decode step at 96 rows took
# 5,829 us against 6,266, at 128 rows 6,517 and 6,700 against 6,911 and 6,863.
NARROW_BATCH = 128
NARROW_N = 4096


def w8a8_takes(num_tokens: int, N: int) -> bool:
    """Whether w8a8_matmul beats torch._scaled_mm on num_tokens rows of an N-wide projection."""
    return num_tokens <= MID_BATCH or (num_tokens <= NARROW_BATCH and N <= NARROW_N)


@triton.jit
def _k_tile(rows, k, rk, row_ok, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(rows + k, mask=row_ok, other=0.0)
    return tl.load(rows + k, mask=row_ok & (k + rk[None, :] < K), other=0.0)


@triton.jit
def _x_tile(x, k, rk, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x + k + rk).to(tl.float32)
    return tl.load(x + k + rk, mask=k + rk < K, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(x, w, w_scale, bias, out, N, K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Row pointers computed once and stepped: 64-bit offsets rebuilt every step made the
    # 14336-wide down projection 1.47x slower (30.6 against 20.7 us on an H200).
    w_rows = w + rn[:, None].to(tl.int64) * K + rk[None, :]
    row_ok = rn[:, None] < N
    # No kernel of a step writes the weights, so the first tile loads before the wait, while
    # the kernel before this one still runs: the FP8 batch-1 step took 2.817 ms against 2.960
    # on an H200. Loading 2 or 4 tiles first, in a variant that summed them apart, made it
    # slower (2.976 and 3.032 ms against 2.871 with one tile, in another call).
    w_first = _k_tile(w_rows, 0, rk, row_ok, K, EVEN_K)
    pdl.wait_for_previous(PDL)
    acc = w_first.to(tl.float32) * _x_tile(x, 0, rk, K, EVEN_K)[None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        acc += (_k_tile(w_rows, k, rk, row_ok, K, EVEN_K).to(tl.float32)
                * _x_tile(x, k, rk, K, EVEN_K)[None, :])
    y = tl.sum(acc, 1) * tl.load(w_scale + rn, mask=rn < N, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out + rn, y.to(out.dtype.element_ty), mask=rn < N)


@triton.jit
def _store_scaled(acc, w_scale, bias, out, rm, rn, M, N, HAS_BIAS: tl.constexpr):
    y = acc * tl.load(w_scale + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rm[:, None] * N + rn[None, :], y.to(out.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _small_batch_kernel(x, w, w_scale, bias, out, M, N, K, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        xk = tl.load(x + rm[:, None] * K + (k + rk)[None, :],
                     mask=(rm[:, None] < M) & (k + rk[None, :] < K), other=0.0)
        wk = tl.load(w + rn[None, :].to(tl.int64) * K + (k + rk)[:, None],
                     mask=(rn[None, :] < N) & (k + rk[:, None] < K), other=0.0)
        # Through fp32: the CPU interpreter converts fp8 straight to bf16 wrongly.
        acc += tl.dot(xk, wk.to(tl.float32).to(xk.dtype))
    _store_scaled(acc, w_scale, bias, out, rm, rn, M, N, HAS_BIAS)


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= SMALL_BATCH, K] contiguous, weight FP8 [N, K], weight_scale float32 [N, 1] ->
    x @ (weight * weight_scale).T + bias, [M, N] in x's dtype."""
    num_tokens, K = x.shape
    N = weight.shape[0]
    out = torch.empty(num_tokens, N, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    bias_arg = weight_scale if bias is None else bias
    # Tilings from a sweep on the H200 with each shape's 32 layers of weights in one CUDA graph
    # (cold L2, launch gaps included), in us per layer: 1024-wide steps for the narrow (N 4096)
    # and the deep (K 14336) projections, o 7.4 and down 21.3 (512-wide 8.8 and 27.6), 512 for
    # qkv 9.7 and gate_up 35.9.
    if num_tokens == 1:
        block_k = 1024 if K >= 8192 or N <= 4096 else 512
        block_k = min(block_k, triton.next_power_of_2(K))
        _gemv_kernel[(triton.cdiv(N, 8),)](x, weight, weight_scale, bias_arg, out, N, K,
                                           HAS_BIAS=bias is not None, BLOCK_N=8, BLOCK_K=block_k,
                                           EVEN_K=K % block_k == 0, num_warps=4,
                                           num_stages=2 if block_k == 1024 else 3,
                                           **pdl.launch_args(x.device))
        return out
    block_k = 256 if N >= 16384 else 512
    # Without PDL: launched with it, and its first weight tile read before the wait as in
    # _gemv_kernel, the FP8 batch-4 decode step took 4.082 ms against 3.791 on an H200 (3.918
    # against 3.908 at batch 16).
    _small_batch_kernel[(triton.cdiv(N, 32),)](x, weight, weight_scale, bias_arg, out, num_tokens, N, K,
                                               HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=32,
                                               BLOCK_K=block_k, num_warps=4,
                                               num_stages=3 if block_k == 256 else 4)
    return out


@triton.jit
def _mid_batch_kernel(x, x_scale, w, w_scale, bias, out, M, N, K, stride_x, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, PDL: tl.constexpr):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x + rm[:, None].to(tl.int64) * stride_x + rk[None, :]
    w_rows = w + rn[:, None].to(tl.int64) * K + rk[None, :]
    pdl.wait_for_previous(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        acc = tl.dot(_k_tile(x_rows, k, rk, rm[:, None] < M, K, EVEN_K),
                     tl.trans(_k_tile(w_rows, k, rk, rn[:, None] < N, K, EVEN_K)), acc)
    _store_scaled(acc * tl.load(x_scale + rm, mask=rm < M, other=0.0)[:, None], w_scale, bias, out, rm, rn, M, N,
                  HAS_BIAS)


def _mid_batch_tiling(N: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, num_stages) of the W8A8 kernel's MID_BATCH x BLOCK_N x MID_BLOCK_K tiles."""
    block_n = 32 if N <= NARROW_N else 64
    stages = 3 if N >= 16384 else 4
    if device.type == "cuda":
        # 24 or 32 KiB a stage: an L4 or L40S (99 KiB of shared memory) takes three or two.
        stages = min(stages, _shared_memory(device.index or 0) // ((MID_BATCH + block_n) * MID_BLOCK_K) - 1)
    return block_n, stages


@functools.cache
def _shared_memory(index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def w8a8_matmul(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """q FP8 [M, K] (rows may be strided), q_scale float32 [M, 1], weight FP8 [N, K],
    weight_scale float32 [N, 1] -> (q * q_scale) @ (weight * weight_scale).T + bias, [M, N] in out_dtype."""
    num_tokens, K = q.shape
    N = weight.shape[0]
    out = torch.empty(num_tokens, N, dtype=out_dtype, device=q.device)
    if num_tokens == 0:
        return out
    block_n, stages = _mid_batch_tiling(N, q.device)
    # With PDL, the kernel after it starts as it ends, as after no cuBLAS GEMM: the FP8 + FP8 KV
    # decode step at 64 rows took 5,351 us against 5,507 without (and 5,926 on cuBLASLt; H100).
    _mid_batch_kernel[(triton.cdiv(N, block_n), triton.cdiv(num_tokens, MID_BATCH))](
        q, q_scale, weight, weight_scale, weight_scale if bias is None else bias, out, num_tokens, N, K,
        q.stride(0), HAS_BIAS=bias is not None, BLOCK_M=MID_BATCH, BLOCK_N=block_n, BLOCK_K=MID_BLOCK_K,
        EVEN_K=K % MID_BLOCK_K == 0, num_warps=4, num_stages=stages, **pdl.launch_args(q.device))
    return out
