"""Tilings of the fused MoE kernels: heuristics, and a table of tilings measured per shape.

A step of M tokens takes the grouped GEMMs of fused_moe.py (a `MoeConfig`) or, at small M, the
GEMVs of moe_gemv.py (a `SmallBatchMoeConfig`). `python -m pagedserve.bench.moe --out DIR` sweeps
both on a GPU (`--small-batch`: the GEMVs against today's entries, M <= 32, in a few minutes) and
prints the entries of TUNED for its shape, ready to paste: a tuned shape then takes, for a step
of M tokens, the entry of the largest M measured at or below it, of either kind.
"""
from dataclasses import dataclass, replace

import torch
import triton

# Shared memory for the pipeline's buffers (an H100 / H200 block may take 227 KiB); some stays free
# for the epilogue's layout conversions.
SMEM_BUDGET = 160 * 1024
# FP8 experts up to this many tokens read activations in their own dtype and widen the weights
# (W8A16): the weight read dominates there, and it saves the two per-token quantization launches,
# as fp8_matmul.SMALL_BATCH does for the linears (not yet measured for MoE: the sweep decides).
W8A16_MAX_TOKENS = 16
# A shape not in TUNED takes the small-batch path up to this many tokens (a guess: the sweep
# decides it per M for the shapes it measures).
GEMV_MAX_TOKENS = 8


@dataclass(frozen=True, slots=True)
class MoeGemmConfig:
    """One grouped GEMM's tiling: output columns and reduction depth per step of a program, how
    many row blocks share a sweep over the columns (for L2 reuse), warps, pipeline stages; and,
    for FP8 experts only, whether activations are quantized per token (W8A8) or read in their own
    dtype with the weights widened to it (W8A16)."""
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    w8a8: bool = True


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The (token, expert) rows per block, shared by both GEMMs since it sets the alignment, and
    the tilings of the gate/up GEMM (with the SiLU-and-mul) and of the down GEMM."""
    block_m: int
    gate_up: MoeGemmConfig
    down: MoeGemmConfig


@dataclass(frozen=True, slots=True)
class MoeGemvConfig:
    """One GEMV of the small-batch path: output columns (rows of the weights) a program
    computes, the reduction depth of each of its steps, warps, pipeline stages."""
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True, slots=True)
class SmallBatchMoeConfig:
    """The small-batch path (moe_gemv.py): the tilings of its gate/up GEMV (a program per slot
    and column tile) and of its down GEMV (a program per token and row tile, over the token's
    k experts). FP8 experts are read W8A16 there."""
    gate_up: MoeGemvConfig
    down: MoeGemvConfig


AnyMoeConfig = MoeConfig | SmallBatchMoeConfig

# (experts, hidden, intermediate per rank, top_k, weight dtype name) -> {M: config}, measured on
# an H200 by the sweep (`python -m pagedserve.bench.moe`, whose output pastes in); a shape not
# here takes the heuristic. A tensor-parallel rank's shape is its own entry (Qwen3-30B-A3B at
# -tp 2: `--intermediate 384`).
TUNED: dict[tuple[int, int, int, int, str], dict[int, AnyMoeConfig]] = {
    # Qwen3-30B-A3B, swept on an H200 (torch 2.11, triton 3.6) by `python -m pagedserve.bench.moe`
    # on 2026-12-02 (BENCHMARKS.md); the small-batch path up to M=12 in bf16 and M=8 in FP8 by
    # `--small-batch` (M=1: 24.0 us against the grouped GEMMs' 38.9, FP8 18.2 against 36.9).
    (128, 2048, 768, 8, "bfloat16"): {
        1: SmallBatchMoeConfig(MoeGemvConfig(2, 1024, 4, 3), MoeGemvConfig(2, 256, 4, 2)),
        2: SmallBatchMoeConfig(MoeGemvConfig(2, 1024, 4, 3), MoeGemvConfig(2, 256, 4, 2)),
        3: SmallBatchMoeConfig(MoeGemvConfig(2, 1024, 4, 2), MoeGemvConfig(2, 256, 4, 2)),
        4: SmallBatchMoeConfig(MoeGemvConfig(4, 512, 4, 3), MoeGemvConfig(2, 256, 4, 3)),
        6: SmallBatchMoeConfig(MoeGemvConfig(4, 512, 4, 3), MoeGemvConfig(2, 256, 4, 3)),
        8: SmallBatchMoeConfig(MoeGemvConfig(4, 512, 4, 2), MoeGemvConfig(2, 256, 4, 2)),
        12: SmallBatchMoeConfig(MoeGemvConfig(4, 512, 4, 3), MoeGemvConfig(2, 256, 4, 3)),
        16: MoeConfig(16, MoeGemmConfig(32, 256, 1, 4, 3), MoeGemmConfig(128, 128, 1, 4, 3)),
        32: MoeConfig(16, MoeGemmConfig(32, 256, 1, 4, 2), MoeGemmConfig(128, 128, 1, 4, 3)),
        64: MoeConfig(16, MoeGemmConfig(32, 256, 1, 4, 3), MoeGemmConfig(64, 256, 1, 4, 2)),
        128: MoeConfig(16, MoeGemmConfig(128, 128, 1, 4, 3), MoeGemmConfig(128, 128, 1, 4, 2)),
        256: MoeConfig(32, MoeGemmConfig(64, 128, 1, 4, 2), MoeGemmConfig(128, 128, 1, 4, 2)),
        512: MoeConfig(64, MoeGemmConfig(64, 64, 1, 4, 3), MoeGemmConfig(128, 64, 1, 4, 4)),
        1024: MoeConfig(128, MoeGemmConfig(128, 64, 1, 8, 4), MoeGemmConfig(256, 64, 8, 8, 4)),
        2048: MoeConfig(128, MoeGemmConfig(128, 64, 1, 8, 4), MoeGemmConfig(256, 64, 8, 8, 4)),
        4096: MoeConfig(128, MoeGemmConfig(128, 64, 1, 8, 4), MoeGemmConfig(256, 64, 8, 8, 4)),
        8192: MoeConfig(128, MoeGemmConfig(128, 64, 8, 8, 3), MoeGemmConfig(256, 64, 8, 8, 3)),
    },
    (128, 2048, 768, 8, "float8_e4m3fn"): {
        1: SmallBatchMoeConfig(MoeGemvConfig(16, 256, 8, 3), MoeGemvConfig(4, 256, 8, 2)),
        2: SmallBatchMoeConfig(MoeGemvConfig(8, 512, 4, 3), MoeGemvConfig(4, 256, 4, 2)),
        3: SmallBatchMoeConfig(MoeGemvConfig(8, 512, 4, 2), MoeGemvConfig(16, 256, 4, 3)),
        4: SmallBatchMoeConfig(MoeGemvConfig(16, 256, 4, 3), MoeGemvConfig(4, 256, 4, 2)),
        6: SmallBatchMoeConfig(MoeGemvConfig(8, 512, 4, 2), MoeGemvConfig(4, 256, 4, 2)),
        8: SmallBatchMoeConfig(MoeGemvConfig(16, 256, 4, 3), MoeGemvConfig(4, 256, 4, 3)),
        12: MoeConfig(16, MoeGemmConfig(32, 256, 1, 4, 3), MoeGemmConfig(64, 128, 1, 4, 4)),
        16: MoeConfig(16, MoeGemmConfig(64, 256, 1, 4, 2), MoeGemmConfig(64, 128, 1, 4, 3)),
        32: MoeConfig(16, MoeGemmConfig(32, 256, 1, 4, 3), MoeGemmConfig(64, 128, 1, 4, 4)),
        64: MoeConfig(16, MoeGemmConfig(64, 256, 1, 4, 2), MoeGemmConfig(128, 128, 1, 4, 3)),
        128: MoeConfig(16, MoeGemmConfig(32, 256, 1, 4, 3), MoeGemmConfig(64, 128, 1, 4, 3)),
        256: MoeConfig(32, MoeGemmConfig(64, 128, 1, 4, 3), MoeGemmConfig(64, 128, 1, 4, 4)),
        512: MoeConfig(64, MoeGemmConfig(64, 128, 1, 4, 3), MoeGemmConfig(128, 128, 1, 8, 3)),
        1024: MoeConfig(64, MoeGemmConfig(64, 128, 1, 4, 3), MoeGemmConfig(128, 128, 1, 4, 3)),
        2048: MoeConfig(128, MoeGemmConfig(128, 128, 8, 8, 4), MoeGemmConfig(256, 128, 8, 8, 4)),
        4096: MoeConfig(128, MoeGemmConfig(64, 128, 1, 8, 3), MoeGemmConfig(256, 128, 8, 8, 4)),
        8192: MoeConfig(128, MoeGemmConfig(128, 64, 8, 8, 4), MoeGemmConfig(256, 128, 8, 8, 4)),
    },
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def moe_config(num_tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int,
               weight_dtype: torch.dtype, act_dtype: torch.dtype,
               table: dict[tuple[int, int, int, int, str], dict[int, AnyMoeConfig]] | None = None
               ) -> AnyMoeConfig:
    """The path and tiling `fused_moe` uses for M = num_tokens: the tuned one of `table` (TUNED
    by default) for the largest M measured at or below num_tokens (the smallest above, below
    them all), else `default_gemv_config` up to GEMV_MAX_TOKENS and `default_config` past it."""
    tuned = (TUNED if table is None else table).get(
        (num_experts, hidden, intermediate, top_k, dtype_name(weight_dtype)))
    if tuned:
        return tuned_entry(tuned, num_tokens)
    if num_tokens <= GEMV_MAX_TOKENS:
        return default_gemv_config(hidden, intermediate, weight_dtype)
    return default_config(num_tokens, num_experts, hidden, intermediate, top_k, weight_dtype, act_dtype)


def tuned_entry(entries: dict[int, AnyMoeConfig], num_tokens: int) -> AnyMoeConfig:
    """The entry of the largest M at or below num_tokens (the smallest M, below them all)."""
    return entries[max((m for m in entries if m <= num_tokens), default=min(entries))]


def default_gemv_config(hidden: int, intermediate: int, weight_dtype: torch.dtype) -> SmallBatchMoeConfig:
    """The small-batch path's heuristic: 1 KiB of each weight row a step (fp8_matmul's GEMV
    reads 512 to 1024 bytes), 4 rows of gate and of up a program, 2 rows of each of the k
    experts for down; steps clamped to the shape."""
    row = 1024 // weight_dtype.itemsize
    return SmallBatchMoeConfig(
        MoeGemvConfig(min(4, triton.next_power_of_2(intermediate)), min(row, triton.next_power_of_2(hidden))),
        MoeGemvConfig(2, min(row, triton.next_power_of_2(intermediate))))


def default_config(num_tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int,
                   weight_dtype: torch.dtype, act_dtype: torch.dtype) -> MoeConfig:
    """The grouped GEMMs' heuristic, by the rows each expert gets on average (M x top_k / E);
    tiles are clamped to the shape and stages to the shared memory."""
    # After vLLM's tuned H200 tables for E=128, N=768: 16-row blocks while an expert gets a
    # few rows (decode), wider and deeper tiles as the blocks fill (prefill). The gate/up tile is
    # half as wide as vLLM's: a program holds the gate and the up columns of its outputs.
    rows = num_tokens * top_k / num_experts
    if rows <= 8:
        block_m, gate_up, down = 16, MoeGemmConfig(32, 128), MoeGemmConfig(64, 128)
    elif rows <= 24:
        block_m, gate_up, down = 32, MoeGemmConfig(64, 128, 1, 4, 3), MoeGemmConfig(128, 128, 1, 4, 3)
    elif rows <= 48:
        block_m, gate_up, down = 64, MoeGemmConfig(64, 64, 1, 4, 3), MoeGemmConfig(128, 64, 1, 4, 3)
    else:
        block_m, gate_up, down = 128, MoeGemmConfig(128, 64, 8, 8, 4), MoeGemmConfig(256, 64, 8, 8, 4)
    fp8 = weight_dtype.itemsize == 1
    w8a8 = fp8 and num_tokens > W8A16_MAX_TOKENS
    a_bytes = 1 if w8a8 else act_dtype.itemsize

    def fit(tiling: MoeGemmConfig, n: int, k: int, gated: bool) -> MoeGemmConfig:
        tiling = replace(tiling, block_n=min(tiling.block_n, max(16, triton.next_power_of_2(n))),
                         block_k=min(tiling.block_k, max(min_block_k(a_bytes), triton.next_power_of_2(k))),
                         w8a8=w8a8)
        return fit_stages(tiling, block_m, a_bytes, weight_dtype.itemsize, gated)

    return MoeConfig(block_m, fit(gate_up, intermediate, hidden, True),
                     fit(down, hidden, intermediate, False))


def stage_bytes(tiling: MoeGemmConfig, block_m: int, a_bytes: int, w_bytes: int, gated: bool) -> int:
    """Shared memory one pipeline stage holds: an activation tile and one weight tile (two, gate
    and up, when gated)."""
    return tiling.block_k * (block_m * a_bytes + (2 if gated else 1) * tiling.block_n * w_bytes)


def min_block_k(a_bytes: int) -> int:
    """The shallowest step a dot takes: 32 for FP8 operands (Hopper's FP8 MMA), else 16."""
    return 32 if a_bytes == 1 else 16


def fit_stages(tiling: MoeGemmConfig, block_m: int, a_bytes: int, w_bytes: int,
               gated: bool) -> MoeGemmConfig:
    """The tiling with as many of its stages as SMEM_BUDGET holds, halving block_k (down to
    min_block_k) while even two stages do not fit."""
    while (tiling.block_k > min_block_k(a_bytes)
           and 2 * stage_bytes(tiling, block_m, a_bytes, w_bytes, gated) > SMEM_BUDGET):
        tiling = replace(tiling, block_k=tiling.block_k // 2)
    per_stage = stage_bytes(tiling, block_m, a_bytes, w_bytes, gated)
    return replace(tiling, num_stages=max(2, min(tiling.num_stages, SMEM_BUDGET // per_stage)))
