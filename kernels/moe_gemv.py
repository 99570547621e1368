"""The small-batch path of fused_moe: GEMVs that read each slot's expert from topk_ids directly.

At a few tokens the grouped GEMMs of fused_moe.py are bound by reading the experts, yet pay an
alignment launch, 16-row blocks of which one row is real, and a launch summing each token's k
slots. Here (layouts in fused_moe.py) there is no alignment and no sum:
- gate/up: a program per (slot, tile of block_n intermediate columns) streams those gate and up
  rows of the slot's expert against the token's x and writes silu(gate) * up ([T * k, I]);
- down: a program per (token, tile of block_n hidden rows) streams those rows of the token's k
  experts against their slots' intermediates and writes the token's output row once, the
  routing weights applied in registers.
Both read weights contiguously in [block_n, block_k] tiles (FP8 experts widened to float32, the
activations kept in their dtype: W8A16) and reduce in float32 without tensor cores. The programs
of one column tile run next to each other (the slot or token varies fastest), so slots whose
experts coincide read the shared rows from L2. Nothing is read back to the host: a CUDA graph can capture it.
"""
import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.moe_config import MoeGemvConfig, SmallBatchMoeConfig


@triton.jit
def _load_k(ptrs, k, rk, K, EVEN_K: tl.constexpr):
    """The elements at ptrs + k, those whose column k + rk is past K read as 0 (rk shaped to
    broadcast against ptrs)."""
    if EVEN_K:
        return tl.load(ptrs + k)
    return tl.load(ptrs + k, mask=k + rk < K, other=0.0)


@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_kernel(x, w13, w13_scale, topk_ids, out, num_slots, N, K, stride_x, stride_we,
                    TOP_K: tl.constexpr, SCALED: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    slot = pid % num_slots
    cn = (pid // num_slots) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N wrap around to real rows, so the weight loads need no mask; the store drops them.
    rn = cn % N
    rk = tl.arange(0, BLOCK_K)
    pdl.wait_for_previous(PDL)
    expert = tl.load(topk_ids + slot).to(tl.int64)
    gate_rows = w13 + expert * stride_we + rn[:, None] * K + rk[None, :]
    up_rows = gate_rows + N * K
    x_row = x + (slot // TOP_K).to(tl.int64) * stride_x + rk
    gate = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k in range(0, K, BLOCK_K):
        xk = _load_k(x_row, k, rk, K, EVEN_K).to(tl.float32)[None, :]
        gate += _load_k(gate_rows, k, rk[None, :], K, EVEN_K).to(tl.float32) * xk
        up += _load_k(up_rows, k, rk[None, :], K, EVEN_K).to(tl.float32) * xk
    g = tl.sum(gate, 1)
    u = tl.sum(up, 1)
    if SCALED:
        scales = w13_scale + expert * 2 * N + rn
        g *= tl.load(scales)
        u *= tl.load(scales + N)
    tl.store(out + slot.to(tl.int64) * N + cn, (g * tl.sigmoid(g) * u).to(out.dtype.element_ty),
             mask=cn < N)


@triton.jit
def _down_step(w, a_rows, k, rk, K, EVEN_K: tl.constexpr):
    """One step's products of the weight tile w [TOP_K_PAD, BLOCK_N, BLOCK_K] with its slots'
    intermediates, summed over the step's columns: the registers then hold [TOP_K_PAD, BLOCK_N]
    partial sums, not a float32 copy of the tile, and the tiles can be deep."""
    a = _load_k(a_rows, k, rk[None, :], K, EVEN_K).to(tl.float32)
    return tl.sum(w.to(tl.float32) * a[:, None, :], 2)


@triton.jit(do_not_specialize=["num_tokens"])
def _down_kernel(inter, w2, w2_scale, topk_weights, topk_ids, out, num_tokens, N, K, stride_we,
                 stride_o, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, SCALED: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    pid = tl.program_id(0)
    token = pid % num_tokens
    cn = (pid // num_tokens) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = cn % N
    rj = tl.arange(0, TOP_K_PAD)
    rk = tl.arange(0, BLOCK_K)
    # Padding lanes (TOP_K not a power of 2) repeat the last slot with weight 0: no masked loads.
    slots = token * TOP_K + tl.minimum(rj, TOP_K - 1)
    # The ids and weights were written before the gate/up kernel (launched just before this one)
    # got past its own wait, which this kernel's early start follows (pdl.py); the experts no
    # kernel writes. So all three are read before this kernel's wait: the first weight tile
    # streams in while the gate/up kernel finishes.
    experts = tl.load(topk_ids + slots).to(tl.int64)
    rows = w2 + experts[:, None, None] * stride_we + rn[None, :, None] * K + rk[None, None, :]
    rk3 = rk[None, None, :]
    w_first = _load_k(rows, 0, rk3, K, EVEN_K)
    coef = tl.where(rj < TOP_K, tl.load(topk_weights + slots), 0.0).to(tl.float32)
    pdl.wait_for_previous(PDL)
    a_rows = inter + slots[:, None].to(tl.int64) * K + rk[None, :]
    acc = _down_step(w_first, a_rows, 0, rk, K, EVEN_K)
    for k in range(BLOCK_K, K, BLOCK_K):
        acc += _down_step(_load_k(rows, k, rk3, K, EVEN_K), a_rows, k, rk, K, EVEN_K)
    acc *= coef[:, None]
    if SCALED:
        acc *= tl.load(w2_scale + experts[:, None] * N + rn[None, :])
    tl.store(out + token.to(tl.int64) * stride_o + cn, tl.sum(acc, 0).to(out.dtype.element_ty),
             mask=cn < N)


def moe_gate_up_gemv(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None,
                     topk_ids: torch.Tensor, tiling: MoeGemvConfig) -> torch.Tensor:
    """silu(gate) * up of each slot -> [T * k, I] in x's dtype: slot t * k + j multiplies x[t]
    by expert topk_ids[t, j]'s rows of w13 [E, 2I, H] (FP8 with w13_scale [E, 2I, 1], or x's
    dtype)."""
    num_slots = topk_ids.numel()
    n, k = w13.shape[1] // 2, w13.shape[2]
    out = torch.empty(num_slots, n, dtype=x.dtype, device=x.device)
    grid = (num_slots * triton.cdiv(n, tiling.block_n),)
    # A pointer a launch does not read is passed as x.
    _gate_up_kernel[grid](x, w13, x if w13_scale is None else w13_scale, topk_ids, out, num_slots,
                          n, k, x.stride(0), w13.stride(0), TOP_K=topk_ids.shape[1],
                          SCALED=w13_scale is not None, EVEN_K=k % tiling.block_k == 0,
                          BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
                          num_warps=tiling.num_warps, num_stages=tiling.num_stages,
                          **pdl.launch_args(x.device))
    return out


def moe_down_gemv(inter: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor | None,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  tiling: MoeGemvConfig) -> torch.Tensor:
    """Each token's sum over its k slots of topk_weights[t, j] * (w2[e] @ inter[t * k + j])
    with e = topk_ids[t, j] -> [T, H] in inter's dtype (w2 [E, H, I], FP8 with w2_scale
    [E, H, 1], or inter's dtype)."""
    num_tokens, top_k = topk_ids.shape
    n, k = w2.shape[1], w2.shape[2]
    out = torch.empty(num_tokens, n, dtype=inter.dtype, device=inter.device)
    grid = (num_tokens * triton.cdiv(n, tiling.block_n),)
    _down_kernel[grid](inter, w2, inter if w2_scale is None else w2_scale, topk_weights, topk_ids,
                       out, num_tokens, n, k, w2.stride(0), out.stride(0), TOP_K=top_k,
                       TOP_K_PAD=triton.next_power_of_2(top_k), SCALED=w2_scale is not None,
                       EVEN_K=k % tiling.block_k == 0, BLOCK_N=tiling.block_n,
                       BLOCK_K=tiling.block_k, num_warps=tiling.num_warps,
                       num_stages=tiling.num_stages, **pdl.launch_args(inter.device))
    return out


def fused_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, w13_scale: torch.Tensor | None,
                   w2_scale: torch.Tensor | None, config: SmallBatchMoeConfig) -> torch.Tensor:
    """fused_moe's result through the small-batch path: two launches."""
    inter = moe_gate_up_gemv(x, w13, w13_scale, topk_ids, config.gate_up)
    return moe_down_gemv(inter, w2, w2_scale, topk_weights, topk_ids, config.down)
