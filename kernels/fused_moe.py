"""Fused mixture-of-experts layer: two grouped GEMMs over the tokens sorted by expert.

Layouts (E experts, H hidden, I intermediate per rank, T tokens, k experts a token):
- x [T, H] in bfloat16, float16 or float32, rows contiguous.
- w13 [E, 2 * I, H]: each expert's gate_proj rows [0, I) then its up_proj rows [I, 2 * I), as
  nn.Linear weights ([out, in]); w2 [E, H, I]: each expert's down_proj. Contiguous. A tensor-
  parallel rank holds rows [r * I', (r + 1) * I') of the gate and of the up half (I' = I / tp)
  and the same columns of w2, and all-reduces the output.
- FP8 experts: w13 and w2 in float8_e4m3fn with float32 scales w13_scale [E, 2 * I, 1] and
  w2_scale [E, H, 1], one per expert and output channel, W ~ q * scale (`quantize_experts_fp8`).
  Activations are quantized per token as they arrive (W8A8) or kept in their dtype with the
  weights widened to it (W8A16), per GEMM, as the config says (`MoeGemmConfig.w8a8`).
- topk_weights [T, k] (float32 from `route`) and topk_ids [T, k] (int32 from `route`, or int64),
  contiguous.
- The result [T, H] in x's dtype: out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
  with e = topk_ids[t, j], as `fused_moe_ref`.

The gate/up GEMM computes each program's gate and up columns together and writes silu(gate) * up
for each slot ([T * k, I]); the down GEMM scales each slot's row by its routing weight
([T * k, H]); the k slots of a token are then summed. Each block of the alignment reads one
expert's weight tiles once for up to block_m slots; an expert that no token chose costs nothing.
Nothing is read back to the host and every buffer's size follows from T: a CUDA graph captured at
a batch size replays it (the config, picked from T on the host, is fixed at capture).

At small T the config may name the small-batch path instead (moe_gemv.py: no alignment, no sum).
"""
import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.moe_config import AnyMoeConfig, MoeGemmConfig, SmallBatchMoeConfig, moe_config
from pagedserve.kernels.moe_gemv import fused_moe_gemv
from pagedserve.kernels.moe_routing import MoeAlignment, moe_align
from pagedserve.kernels.quant import INTERPRETED, per_token_quant_fp8
from pagedserve.kernels.reference import FP8_DTYPE


@triton.jit
def _tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """The (row block, column tile) of program pid: GROUP_M row blocks sweep the columns together."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _dot(a, b, acc, INTERPRETER: tl.constexpr):
    # FP8 x FP8 (W8A8) or 16-bit x 16-bit, an FP8 weight widened to the activations' dtype (W8A16);
    # all float32 under the interpreter, whose bf16 dot is wrong and fp8 -> bf16 cast too.
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b.to(a.dtype), acc)


@triton.jit
def _rounded(acc, dtype: tl.constexpr, INTERPRETER: tl.constexpr):
    """acc (float32) in dtype, rounded to nearest even: the interpreter truncates to bf16, and the
    FP8 quantization of the gate/up output after it would then differ from a GPU's."""
    if INTERPRETER and dtype == tl.bfloat16:
        bits = acc.to(tl.uint32, bitcast=True)
        acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return acc.to(dtype)


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def _expert_gemm_kernel(a, a_scale, b, b_scale, c, topk_weights, sorted_ids, expert_ids, num_padded,
                        num_slots, num_blocks, N, K, stride_a, stride_be, stride_bn, stride_c,
                        A_ROWS_PER_SLOT: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr,
                        A_SCALED: tl.constexpr, B_SCALED: tl.constexpr, INTERPRETER: tl.constexpr,
                        EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """c[slot, :N] for each slot of a block = a[slot // A_ROWS_PER_SLOT] @ b[expert].T, with
    GATED: silu(gate) * up of b's rows [0, N) and [N, 2N); ROUTED: times the slot's weight."""
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    pdl.wait_for_previous(PDL)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    slots = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    real = slots < num_slots
    a_rows = (slots // A_ROWS_PER_SLOT).to(tl.int64)
    expert = tl.load(expert_ids + pid_m).to(tl.int64)
    # Columns past N wrap around to real rows of b, so its loads need no mask; the store drops them.
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a + a_rows[:, None] * stride_a + rk[None, :]
    b_ptrs = b + expert * stride_be + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]
    up_offset = N * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a_tile = tl.load(a_ptrs, mask=real[:, None], other=0.0)
            b_tile = tl.load(b_ptrs)
            if GATED:
                up_tile = tl.load(b_ptrs + up_offset)
        else:
            k_ok = rk < K - k
            a_tile = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
            b_tile = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            if GATED:
                up_tile = tl.load(b_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
        acc = _dot(a_tile, b_tile, acc, INTERPRETER)
        if GATED:
            up = _dot(a_tile, up_tile, up, INTERPRETER)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if A_SCALED:
        a_s = tl.load(a_scale + a_rows, mask=real, other=0.0)[:, None]
        acc *= a_s
        up *= a_s
    if B_SCALED:
        if GATED:
            gate_scales = b_scale + expert * 2 * N + rn
            acc *= tl.load(gate_scales)[None, :]
            up *= tl.load(gate_scales + N)[None, :]
        else:
            acc *= tl.load(b_scale + expert * N + rn)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * up
    if ROUTED:
        acc *= tl.load(topk_weights + slots, mask=real, other=0.0).to(tl.float32)[:, None]
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c + slots[:, None].to(tl.int64) * stride_c + cn[None, :],
             _rounded(acc, c.dtype.element_ty, INTERPRETER), mask=real[:, None] & (cn[None, :] < N))


def expert_gemm(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
                alignment: MoeAlignment, tiling: MoeGemmConfig, *, a_rows_per_slot: int,
                gated: bool, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """One grouped GEMM of `fused_moe` -> [num_slots, N] in a's dtype: slot s multiplies row
    s // a_rows_per_slot of a [rows, K] by its expert's w [E, N or 2N when gated, K]; gated
    writes silu(gate) * up (N = w.shape[1] // 2); topk_weights [T, k] scale each slot's row.
    For FP8 w, a is quantized per token here when tiling.w8a8."""
    num_slots = alignment.num_slots
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    out = torch.empty(num_slots, n, dtype=a.dtype, device=a.device)
    a_scale = None
    if w.dtype == FP8_DTYPE and tiling.w8a8:
        a, a_scale = per_token_quant_fp8(a)
    num_blocks = alignment.max_blocks
    grid = (num_blocks * triton.cdiv(n, tiling.block_n),)
    # Pointers a launch does not read are passed as `a`.
    _expert_gemm_kernel[grid](
        a, a if a_scale is None else a_scale, w, a if w_scale is None else w_scale, out,
        a if topk_weights is None else topk_weights, alignment.sorted_ids, alignment.expert_ids,
        alignment.num_padded, num_slots, num_blocks, n, k, a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), A_ROWS_PER_SLOT=a_rows_per_slot, GATED=gated,
        ROUTED=topk_weights is not None, A_SCALED=a_scale is not None,
        B_SCALED=w_scale is not None, INTERPRETER=INTERPRETED, EVEN_K=k % tiling.block_k == 0,
        BLOCK_M=alignment.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
        GROUP_M=tiling.group_m, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
        **pdl.launch_args(a.device))
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, config: AnyMoeConfig | None = None) -> torch.Tensor:
    """The mixture of experts of x [T, H] over the experts topk_ids chose, weighted by
    topk_weights -> [T, H] in x's dtype (layouts in the module docstring). `config` overrides
    the path and tiling `moe_config` picks for T."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"expert weights must be w13 [E, 2I, H] and w2 [E, H, I] for x [T, {hidden}]; "
                         f"got w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}")
    if num_tokens == 0:
        return torch.empty_like(x)
    cfg = config or moe_config(num_tokens, num_experts, hidden, two_i // 2, top_k, w13.dtype, x.dtype)
    if isinstance(cfg, SmallBatchMoeConfig):
        return fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, cfg)
    alignment = moe_align(topk_ids, num_experts, cfg.block_m)
    inter = expert_gemm(x, w13, w13_scale, alignment, cfg.gate_up, a_rows_per_slot=top_k, gated=True)
    slots = expert_gemm(inter, w2, w2_scale, alignment, cfg.down, a_rows_per_slot=1, gated=False,
                        topk_weights=topk_weights)
    if top_k == 1:
        return slots
    return slots.view(num_tokens, top_k, hidden).sum(dim=1)


def quantize_experts_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights w [E, N, K] -> (FP8 E4M3 [E, N, K], float32 scale [E, N, 1]), each expert's
    output channel scaled by its absmax / 448, as `quantize_experts_fp8_ref` (and as
    `--quantization fp8` quantizes a linear layer's weight)."""
    q, scale = per_token_quant_fp8(w.reshape(-1, w.shape[-1]))
    return q.view(w.shape), scale.view(*w.shape[:2], 1)
