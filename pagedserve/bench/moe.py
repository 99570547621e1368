"""Fused MoE kernels on one GPU: a correctness check, a tiling sweep per token count, the TUNED
entries it finds, and each token count's time against the roofline.

Run as `python -m pagedserve.bench.moe --out DIR` (about 7 minutes on an H200). At the
Qwen3-30B-A3B shape (128 experts, hidden 2048, intermediate 768, top-8), for bf16 and for FP8
experts, it
1. checks both paths of fused_moe (the grouped GEMMs, the small-batch GEMVs) against
   fused_moe_ref at a few token counts (exits 1 on a mismatch);
2. compiles every tiling of the sweep in worker processes, whose Triton cache the timing process
   then reads;
3. for each M, times the alignment and each GEMM tiling at each candidate block_m (do_bench,
   L2 flushed before each run), checks each tiling's output against the heuristic's and keeps the
   fastest sum; then times fused_moe with that config and with the heuristic's as LAYERS layers
   of distinct weights in one CUDA graph (cold L2 and launch gaps, as in a decode step), and
   `route` against `route_ref` the same way;
4. for each M up to GEMV_SWEEP_MAX, times each tiling of the two small-batch GEMVs as LAYERS
   launches in one graph (checked against the heuristic's output), and the layer with the
   fastest of each against the layer with the grouped GEMMs' config for that M, as in 3;
5. prints each M against the roofline (bytes of the experts the step touches / HBM_BYTES_PER_S,
   matmul FLOPs / MATMUL_FLOPS), the faster path at each M, and the TUNED entries to paste into
   kernels/moe_config.py: the small-batch path up to the largest M below which it won at every
   M, the grouped GEMMs past it; writes them (moe_tuned.txt) and every timing (moe_sweep.json)
   under DIR.
`--small-batch` does 1, 4 and 5 alone (about 3 minutes), against the grouped configs TUNED holds
for the shape: its entries then replace that shape's. `--tiny` runs the same code at a toy shape
with one tiling beside each heuristic's, on a CPU too (TRITON_INTERPRET=1; its times mean
nothing), so that the path is tested without a GPU.
"""
import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, astuple, dataclass, fields, replace
from itertools import product
from pathlib import Path

import torch
import triton

from pagedserve.bench.timing import graph_ms, median_ms
from pagedserve.kernels import moe_config
from pagedserve.kernels.fused_moe import expert_gemm, fused_moe
from pagedserve.kernels.moe_config import (GEMV_MAX_TOKENS, TUNED, AnyMoeConfig, MoeConfig, MoeGemmConfig,
                                           MoeGemvConfig, SmallBatchMoeConfig, default_config,
                                           default_gemv_config, dtype_name, stage_bytes, tuned_entry)
from pagedserve.kernels.moe_gemv import moe_down_gemv, moe_gate_up_gemv
from pagedserve.kernels.moe_routing import MoeAlignment, moe_align, route
from pagedserve.kernels.reference import FP8_DTYPE, fused_moe_ref, quantize_experts_fp8_ref, route_ref

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CHECK_TOKENS = (1, 37, 1024)
# The small-batch path is swept up to GEMV_SWEEP_MAX tokens.
GEMV_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
GEMV_CHECK_TOKENS = (1, 5, 32)
GEMV_SWEEP_MAX = 32
# A small-batch GEMV tiling is tried if a step's weight tile is 8 to 64 KiB, and at most 512
# bytes of it (and of the gate/up GEMV's float32 sums) fall to each thread: past that it spills.
GEMV_TILE_BYTES = (8 * 1024, 64 * 1024)
GEMV_THREAD_BYTES = 512
HBM_BYTES_PER_S = 4.8e12
MATMUL_FLOPS = {"bf16": 800e12, "fp8": 1600e12}
# Each layer reads at least 75 MB of bf16 experts at batch 1, more than the H200's 50 MB L2.
LAYERS = 4
MAX_REL_ERR = 2e-2
# Tilings whose pipeline buffers need more shared memory than this are left out (an H200 block:
# 227 KiB). Triton 3.9 allocates num_stages - 1 buffers for the 16-row blocks' mma.sync pipeline,
# num_stages for wgmma's: counting num_stages - 1 leaves the GPU to refuse the rest.
SWEEP_SMEM = 227 * 1024
# FP8 experts are tried with activations in bf16 (W8A16) up to this many tokens.
W8A16_SWEEP_TOKENS = 64
ACT_DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class Shape:
    experts: int
    hidden: int
    inter: int
    top_k: int


QWEN3_30B_A3B = Shape(128, 2048, 768, 8)
TINY = Shape(4, 32, 24, 2)
# Beside the heuristics'.
TINY_TILINGS = (MoeGemmConfig(16, 32, 2, 4, 2),)
TINY_GEMV_TILINGS = (MoeGemvConfig(8, 16, 2),)


@dataclass(frozen=True, slots=True)
class Plan:
    """The token counts of the grouped GEMMs' sweep (none with --small-batch) and checks, and of
    the small-batch path's."""
    shape: Shape
    tokens: tuple[int, ...]
    check_tokens: tuple[int, ...]
    gemv_tokens: tuple[int, ...]
    gemv_check_tokens: tuple[int, ...]
    layers: int
    tiny: bool


@dataclass(slots=True)
class Experts:
    """One layer's experts: bf16, or FP8 with their scales."""
    kind: str
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def scales(self) -> dict[str, torch.Tensor | None]:
        return {"w13_scale": self.w13_scale, "w2_scale": self.w2_scale}


@dataclass(slots=True)
class Batch:
    """M tokens and their routing."""
    x: torch.Tensor
    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor


def make_experts(shape: Shape, kind: str, device: torch.device) -> Experts:
    w13 = torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device=device) * shape.hidden ** -0.5
    w2 = torch.randn(shape.experts, shape.hidden, shape.inter, device=device) * shape.inter ** -0.5
    if kind == "bf16":
        return Experts(kind, w13.to(ACT_DTYPE), w2.to(ACT_DTYPE))
    (q13, s13), (q2, s2) = quantize_experts_fp8_ref(w13), quantize_experts_fp8_ref(w2)
    return Experts(kind, q13, q2, s13, s2)


def make_batch(shape: Shape, num_tokens: int, device: torch.device) -> Batch:
    logits = torch.randn(num_tokens, shape.experts, device=device).to(ACT_DTYPE)
    x = torch.randn(num_tokens, shape.hidden, device=device).to(ACT_DTYPE)
    return Batch(x, logits, *route(logits, shape.top_k, renormalize=True))


def weight_dtype(kind: str) -> torch.dtype:
    return FP8_DTYPE if kind == "fp8" else ACT_DTYPE


def heuristic(shape: Shape, kind: str, num_tokens: int) -> MoeConfig:
    return default_config(num_tokens, shape.experts, shape.hidden, shape.inter, shape.top_k,
                          weight_dtype(kind), ACT_DTYPE)


def gemv_heuristic(shape: Shape, kind: str) -> SmallBatchMoeConfig:
    return default_gemv_config(shape.hidden, shape.inter, weight_dtype(kind))


def with_w8a8(config: MoeConfig, w8a8: bool) -> MoeConfig:
    return replace(config, gate_up=replace(config.gate_up, w8a8=w8a8), down=replace(config.down, w8a8=w8a8))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


# Correctness

def check(plan: Plan, layers: dict[str, Experts], device: torch.device) -> list[dict]:
    """fused_moe against fused_moe_ref at each check token count, each kind and FP8 mode: the
    grouped GEMMs' heuristic, then the small-batch path's (FP8 experts W8A16 there)."""
    cases = [(kind, m, with_w8a8(heuristic(plan.shape, kind, m), w8a8), w8a8)
             for kind, m in product(layers, plan.check_tokens)
             for w8a8 in ((True, False) if kind == "fp8" else (True,))]
    cases += [(kind, m, gemv_heuristic(plan.shape, kind), False)
              for kind, m in product(layers, plan.gemv_check_tokens)]
    return [check_one(layers[kind], make_batch(plan.shape, m, device), config, w8a8)
            for kind, m, config, w8a8 in cases]


def check_one(layer: Experts, batch: Batch, config: AnyMoeConfig, w8a8: bool) -> dict:
    out = fused_moe(batch.x, layer.w13, layer.w2, batch.weights, batch.ids, config=config, **layer.scales)
    ref = fused_moe_ref(batch.x, layer.w13, layer.w2, batch.weights, batch.ids,
                        layer.w13_scale, layer.w2_scale, w8a8, w8a8)
    err = rel_err(out, ref)
    path = "small-batch" if isinstance(config, SmallBatchMoeConfig) else "grouped"
    row = {"kind": layer.kind, "path": path, "w8a8": w8a8, "tokens": batch.x.shape[0], "rel_err": err,
           "ok": err < MAX_REL_ERR and not out.isnan().any().item()}
    mode = " w8a8" if layer.kind == "fp8" and w8a8 else "     "
    print(f"check {layer.kind:4s} {path:11s}{mode} M={row['tokens']:5d}: rel err vs reference {err:.2e} "
          f"{'ok' if row['ok'] else 'FAILED'}", flush=True)
    return row


# The search space

def block_m_candidates(shape: Shape, num_tokens: int) -> list[int]:
    """Row blocks around the rows each expert gets on average (M x top_k / E)."""
    rows = num_tokens * shape.top_k / shape.experts
    if rows < 4:
        return [16]
    target = min(128, max(16, triton.next_power_of_2(int(rows))))
    return sorted({max(16, target // 2), target, min(128, 2 * target)})


def tilings(plan: Plan, block_m: int, gated: bool, a_bytes: int, w_bytes: int) -> list[MoeGemmConfig]:
    """The tilings tried for one GEMM at block_m: narrow and deep for decode-sized blocks, wide and
    more warps for prefill-sized ones; those surely past SWEEP_SMEM left out."""
    if plan.tiny:
        return list(TINY_TILINGS)
    if block_m <= 32:
        space = product((32, 64, 128), (64, 128, 256), (1,), (4,), (2, 3, 4))
    elif block_m == 64:
        space = product((64, 128), (64, 128), (1,), (4, 8), (3, 4))
    else:
        space = product((64, 128) if gated else (64, 128, 256), (64, 128), (1, 8), (8,), (3, 4))
    found = [MoeGemmConfig(*t) for t in space if t[0] * t[1] <= 128 * 128 or block_m > 32]
    return [t for t in found
            if (t.num_stages - 1) * stage_bytes(t, block_m, a_bytes, w_bytes, gated) <= SWEEP_SMEM]


def gemv_tilings(plan: Plan, gated: bool, w_bytes: int) -> list[MoeGemvConfig]:
    """The tilings tried for one small-batch GEMV (GEMV_TILE_BYTES, GEMV_THREAD_BYTES), steps
    clamped to the reduction's depth. A weight tile holds block_n rows of gate and of up, or
    of each of the k experts (padded to a power of 2) for down."""
    if plan.tiny:
        return list(TINY_GEMV_TILINGS)
    depth = triton.next_power_of_2(plan.shape.hidden if gated else plan.shape.inter)
    tile_rows = 2 if gated else triton.next_power_of_2(plan.shape.top_k)
    found = set()
    for n, k, warps, stages in product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (4, 8), (2, 3)):
        tile = tile_rows * n * min(k, depth)
        # Per element, the gate/up GEMV holds a float32 sum, the down GEMV the weight alone.
        held = 4 if gated else w_bytes
        if (GEMV_TILE_BYTES[0] <= tile * w_bytes <= GEMV_TILE_BYTES[1]
                and tile * held <= GEMV_THREAD_BYTES * 32 * warps):
            found.add(MoeGemvConfig(n, min(k, depth), warps, stages))
    return sorted(found, key=astuple)


def gemv_jobs(plan: Plan, kind: str) -> list[tuple[int, bool, MoeGemvConfig]]:
    """(0, gated, tiling) of every small-batch GEMV launch the sweep times (at every M): the
    search space and the heuristic's tilings."""
    default = gemv_heuristic(plan.shape, kind)
    w_bytes = weight_dtype(kind).itemsize
    out = [(0, True, default.gate_up), (0, False, default.down)]
    out += [(0, gated, t) for gated in (True, False) for t in gemv_tilings(plan, gated, w_bytes)]
    return list(dict.fromkeys(out))


def tuned_jobs(plan: Plan, kind: str) -> set[tuple[int, bool, MoeGemmConfig]]:
    """(block_m, gated, tiling) of the grouped GEMM launches of TUNED's configs, which
    --small-batch times the small-batch path against."""
    grouped = tuned_grouped(plan.shape, kind)
    configs = {tuned_entry(grouped, m) for m in plan.gemv_tokens} if grouped else set()
    return {(c.block_m, gated, t) for c in configs for gated, t in ((True, c.gate_up), (False, c.down))}


def modes(kind: str, num_tokens: int) -> list[bool]:
    """The w8a8 settings tried: FP8 experts also in W8A16 at small M."""
    if kind != "fp8":
        return [True]
    return [True, False] if num_tokens <= W8A16_SWEEP_TOKENS else [True]


def jobs_of(plan: Plan, kind: str, num_tokens: int) -> list[tuple[int, bool, MoeGemmConfig]]:
    """(block_m, gated, tiling) of every GEMM launch the sweep times at M = num_tokens: the
    search space and the heuristic's tilings (its block_m is always a candidate)."""
    w_bytes = 1 if kind == "fp8" else 2
    out = []
    for w8a8 in modes(kind, num_tokens):
        default = with_w8a8(heuristic(plan.shape, kind, num_tokens), w8a8)
        out += [(default.block_m, True, default.gate_up), (default.block_m, False, default.down)]
        a_bytes = 1 if kind == "fp8" and w8a8 else 2
        for block_m, gated in product(block_m_candidates(plan.shape, num_tokens), (True, False)):
            out += [(block_m, gated, replace(t, w8a8=w8a8))
                    for t in tilings(plan, block_m, gated, a_bytes, w_bytes)]
    return list(dict.fromkeys(out))


# Compiling ahead, in parallel

_WORKER_STATE: dict = {}


def _compile(shape: Shape, kind: str, jobs: list[tuple[int, bool, MoeGemmConfig | MoeGemvConfig]]) -> int:
    """Runs each job once at a representative M, for Triton to compile and cache it; returns how
    many failed (a tiling the GPU refuses, reported again when it is timed). The small-batch
    GEMVs compile once for every M: they do not specialize on the token count."""
    device = torch.device("cuda")
    if kind not in _WORKER_STATE:
        _WORKER_STATE[kind] = (make_experts(shape, kind, device), make_batch(shape, 64, device))
    layer, batch = _WORKER_STATE[kind]
    failed = 0
    for block_m, gated, tiling in jobs:
        try:
            if isinstance(tiling, MoeGemvConfig):
                run_gemv(layer, batch, tiling, gated, _inter(shape, batch))
            else:
                run_gemm(layer, batch, moe_align(batch.ids, shape.experts, block_m), tiling, gated,
                         _inter(shape, batch))
        except Exception:  # a tiling the compiler or the GPU refuses: the timing run skips it too
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(plan: Plan, kinds: list[str], workers: int) -> None:
    jobs = {(kind, job) for kind in kinds for m in plan.tokens for job in jobs_of(plan, kind, m)}
    jobs |= {(kind, job) for kind in kinds if plan.gemv_tokens for job in gemv_jobs(plan, kind)}
    if not plan.tokens:
        jobs |= {(kind, job) for kind in kinds for job in tuned_jobs(plan, kind)}
    jobs = sorted(jobs, key=repr)
    start = time.perf_counter()
    chunks = [jobs[i::workers] for i in range(workers)]
    tasks = [(plan.shape, kind, [job for k, job in chunk if k == kind]) for chunk in chunks for kind in kinds]
    tasks = [task for task in tasks if task[2]]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = sum(pool.map(_compile, *zip(*tasks)))
    print(f"compiled {len(jobs)} tilings in {time.perf_counter() - start:.0f} s on {workers} processes "
          f"({failed} refused)", flush=True)


# Timing

def _inter(shape: Shape, batch: Batch) -> torch.Tensor:
    """A down GEMM's input: one row a slot."""
    return torch.randn(batch.ids.numel(), shape.inter, device=batch.x.device).to(ACT_DTYPE)


def run_gemm(layer: Experts, batch: Batch, alignment: MoeAlignment, tiling: MoeGemmConfig, gated: bool,
             inter: torch.Tensor) -> torch.Tensor:
    if gated:
        return expert_gemm(batch.x, layer.w13, layer.w13_scale, alignment, tiling,
                           a_rows_per_slot=batch.ids.shape[1], gated=True)
    return expert_gemm(inter, layer.w2, layer.w2_scale, alignment, tiling, a_rows_per_slot=1,
                       gated=False, topk_weights=batch.weights)


def run_gemv(layer: Experts, batch: Batch, tiling: MoeGemvConfig, gated: bool,
             inter: torch.Tensor) -> torch.Tensor:
    if gated:
        return moe_gate_up_gemv(batch.x, layer.w13, layer.w13_scale, batch.ids, tiling)
    return moe_down_gemv(inter, layer.w2, layer.w2_scale, batch.weights, batch.ids, tiling)


def time_if_right(output: Callable[[], torch.Tensor], expected: torch.Tensor,
                  timer: Callable[[], float]) -> dict:
    """One tiling: the error of its output against `expected` (the heuristic's output in the
    same mode), then its time if within MAX_REL_ERR; a tiling the GPU refuses reports why."""
    try:
        err = rel_err(output(), expected)
    except Exception as failure:  # a tiling the compiler or the GPU refuses: report, go on
        return {"error": f"{type(failure).__name__}: {str(failure).splitlines()[0][:160]}"}
    if not err < MAX_REL_ERR:
        return {"rel_err": err}
    return {"rel_err": err, "ms": timer()}


def time_tiling(layer: Experts, batch: Batch, alignment: MoeAlignment, tiling: MoeGemmConfig, gated: bool,
                inter: torch.Tensor, expected: torch.Tensor) -> dict:
    def output() -> torch.Tensor:
        return run_gemm(layer, batch, alignment, tiling, gated, inter)
    return time_if_right(output, expected, lambda: median_ms(output))


def time_gemv(layers: list[Experts], batch: Batch, tiling: MoeGemvConfig, gated: bool,
              inter: torch.Tensor, expected: torch.Tensor) -> dict:
    """A GEMV of a few microseconds: as one launch a layer in one graph, per layer, so that the
    launch gaps and the overlap PDL gives are as in a step."""
    def launches() -> list[torch.Tensor]:
        return [run_gemv(layer, batch, tiling, gated, inter) for layer in layers]
    return time_if_right(lambda: run_gemv(layers[0], batch, tiling, gated, inter), expected,
                         lambda: graph_ms(launches) / len(layers))


def sweep_block_m(plan: Plan, layer: Experts, batch: Batch, block_m: int, inter: torch.Tensor,
                  expected: dict[tuple[bool, bool], torch.Tensor]) -> dict:
    """Every tiling of both GEMMs at one block_m: {align_ms, gate_up: [...], down: [...]}."""
    num_tokens = batch.x.shape[0]
    alignment = moe_align(batch.ids, plan.shape.experts, block_m)
    row: dict = {"align_ms": median_ms(lambda: moe_align(batch.ids, plan.shape.experts, block_m)),
                 "gate_up": [], "down": []}
    for bm, gated, tiling in jobs_of(plan, layer.kind, num_tokens):
        if bm == block_m:
            result = time_tiling(layer, batch, alignment, tiling, gated, inter, expected[gated, tiling.w8a8])
            row["gate_up" if gated else "down"].append({**asdict(tiling), **result})
    return row


def fastest(results: list[dict], tiling: type = MoeGemmConfig) -> tuple:
    """(tiling, ms) of the fastest of `results`, rows of a tiling's fields and its timing."""
    timed = [r for r in results if "ms" in r]
    if not timed:
        raise RuntimeError(f"no tiling ran correctly: {results[:3]}")
    best = min(timed, key=lambda r: r["ms"])
    return tiling(**{f.name: best[f.name] for f in fields(tiling)}), best["ms"]


def best_config(per_block_m: dict[int, dict]) -> tuple[MoeConfig, float]:
    """The block_m and tilings of the least alignment + gate/up + down time."""
    options = []
    for block_m, row in per_block_m.items():
        (up, up_ms), (down, down_ms) = fastest(row["gate_up"]), fastest(row["down"])
        options.append((row["align_ms"] + up_ms + down_ms, MoeConfig(block_m, up, down)))
    total, config = min(options, key=lambda o: o[0])
    return config, total


def layer_ms(layers: list[Experts], batch: Batch, config: AnyMoeConfig) -> float:
    """fused_moe over every layer in one graph, per layer."""
    def step() -> None:
        for layer in layers:
            fused_moe(batch.x, layer.w13, layer.w2, batch.weights, batch.ids, config=config, **layer.scales)
    return graph_ms(step) / len(layers)


def route_ms(batch: Batch, top_k: int, layers: int) -> dict[str, float]:
    """route (one Triton launch) and route_ref (torch ops), LAYERS calls in one graph, per call."""
    return {name: graph_ms(lambda: [fn(batch.logits, top_k, True) for _ in range(layers)]) / layers
            for name, fn in (("triton", route), ("torch", route_ref))}


def roofline(shape: Shape, kind: str, batch: Batch) -> dict:
    """The least time of the layer at this routing: the bytes of the experts it touches (and of x
    and the output) over HBM_BYTES_PER_S, or its matmul FLOPs over MATMUL_FLOPS, the larger."""
    touched = batch.ids.unique().numel()
    num_tokens = batch.x.shape[0]
    per_expert = 3 * shape.hidden * shape.inter
    nbytes = touched * per_expert * (1 if kind == "fp8" else 2) + 2 * num_tokens * shape.hidden * 2
    memory_ms = nbytes / HBM_BYTES_PER_S * 1e3
    compute_ms = 2 * num_tokens * shape.top_k * per_expert / MATMUL_FLOPS[kind] * 1e3
    return {"touched_experts": touched, "memory_ms": memory_ms, "compute_ms": compute_ms,
            "roofline_ms": max(memory_ms, compute_ms)}


def sweep_tokens(plan: Plan, layers: list[Experts], num_tokens: int, device: torch.device) -> dict:
    """Everything timed at M = num_tokens for one kind of experts."""
    layer = layers[0]
    batch = make_batch(plan.shape, num_tokens, device)
    inter = _inter(plan.shape, batch)
    default = heuristic(plan.shape, layer.kind, num_tokens)
    expected = {}
    for w8a8 in modes(layer.kind, num_tokens):
        reference = with_w8a8(default, w8a8)
        alignment = moe_align(batch.ids, plan.shape.experts, reference.block_m)
        expected[True, w8a8] = run_gemm(layer, batch, alignment, reference.gate_up, True, inter)
        expected[False, w8a8] = run_gemm(layer, batch, alignment, reference.down, False, inter)
    per_block_m = {bm: sweep_block_m(plan, layer, batch, bm, inter, expected)
                   for bm in block_m_candidates(plan.shape, num_tokens)}
    config, parts_ms = best_config(per_block_m)
    return {"tokens": num_tokens, "best": asdict(config), "best_config": config, "parts_ms": parts_ms,
            "layer_ms": layer_ms(layers, batch, config), "default_layer_ms": layer_ms(layers, batch, default),
            **roofline(plan.shape, layer.kind, batch), "route_ms": route_ms(batch, plan.shape.top_k, len(layers)),
            "block_m": per_block_m}


def sweep_gemv_tokens(plan: Plan, layers: list[Experts], num_tokens: int, grouped: MoeConfig,
                      device: torch.device) -> dict:
    """Every small-batch GEMV tiling at M = num_tokens, then the layer with the fastest of each
    against the layer with `grouped`."""
    layer = layers[0]
    batch = make_batch(plan.shape, num_tokens, device)
    inter = _inter(plan.shape, batch)
    default = gemv_heuristic(plan.shape, layer.kind)
    w_bytes = weight_dtype(layer.kind).itemsize
    tilings_ms: dict[str, list[dict]] = {}
    for name, gated, start in (("gate_up", True, default.gate_up), ("down", False, default.down)):
        expected = run_gemv(layer, batch, start, gated, inter)
        candidates = dict.fromkeys([start, *gemv_tilings(plan, gated, w_bytes)])
        tilings_ms[name] = [{**asdict(t), **time_gemv(layers, batch, t, gated, inter, expected)}
                            for t in candidates]
    (gate_up, gate_up_ms), (down, down_ms) = (fastest(tilings_ms[name], MoeGemvConfig)
                                              for name in ("gate_up", "down"))
    config = SmallBatchMoeConfig(gate_up, down)
    return {"tokens": num_tokens, "small_batch": asdict(config), "small_batch_config": config,
            "grouped": asdict(grouped), "grouped_config": grouped, "gate_up_ms": gate_up_ms,
            "down_ms": down_ms, "small_batch_layer_ms": layer_ms(layers, batch, config),
            "grouped_layer_ms": layer_ms(layers, batch, grouped), **roofline(plan.shape, layer.kind, batch),
            "tilings": tilings_ms}


def sweep_small_batch(plan: Plan, kind: str, layers: list[Experts], grouped: dict[int, MoeConfig],
                      device: torch.device) -> list[dict]:
    """The small-batch path at each of plan.gemv_tokens, against the grouped entry of `grouped`
    for that M (the heuristic's if it is empty)."""
    rows = []
    for num_tokens in plan.gemv_tokens:
        start = time.perf_counter()
        against = tuned_entry(grouped, num_tokens) if grouped else heuristic(plan.shape, kind, num_tokens)
        rows.append(sweep_gemv_tokens(plan, layers, num_tokens, against, device))
        print(f"{gemv_line(kind, rows[-1])} [{time.perf_counter() - start:.0f} s]", flush=True)
    return rows


# Reporting

def gemm_literal(tiling: MoeGemmConfig, kind: str) -> str:
    args = f"{tiling.block_n}, {tiling.block_k}, {tiling.group_m}, {tiling.num_warps}, {tiling.num_stages}"
    return f"MoeGemmConfig({args}{', w8a8=False' if kind == 'fp8' and not tiling.w8a8 else ''})"


def config_literal(config: AnyMoeConfig, kind: str) -> str:
    if isinstance(config, SmallBatchMoeConfig):
        gate_up, down = astuple(config.gate_up), astuple(config.down)
        return f"SmallBatchMoeConfig(MoeGemvConfig{gate_up}, MoeGemvConfig{down})"
    return (f"MoeConfig({config.block_m}, {gemm_literal(config.gate_up, kind)}, "
            f"{gemm_literal(config.down, kind)})")


def tuned_literal(shape: Shape, kind: str, entries: dict[int, AnyMoeConfig]) -> str:
    """The TUNED entry of one shape and weight dtype, as Python to paste."""
    dtype = dtype_name(weight_dtype(kind))
    lines = [f'    ({shape.experts}, {shape.hidden}, {shape.inter}, {shape.top_k}, "{dtype}"): {{']
    lines += [f"        {m}: {config_literal(config, kind)}," for m, config in entries.items()]
    return "\n".join(lines + ["    },"])


def paste_tuned(source: str, literal: str) -> str:
    """moe_config.py's source with each shape's block of `literal` in place of that shape's
    block of TUNED, or first in TUNED if the shape has none."""
    for block in re.findall(r"^    \(.*?\): \{\n.*?^    \},\n", literal + "\n", re.M | re.S):
        head = block.split("\n", 1)[0]
        old = re.compile("^" + re.escape(head) + r"\n.*?^    \},\n", re.M | re.S)
        source, found = old.subn(lambda _: block, source, count=1)
        if not found:
            source = re.sub(r"^(TUNED: .*= \{\n)", lambda m: m.group(1) + block, source, count=1, flags=re.M)
    return source


def small_batch_threshold(rows: list[dict]) -> int:
    """The largest M up to which the small-batch path beat the grouped GEMMs at every M swept
    (0 if it lost at the first)."""
    threshold = 0
    for row in sorted(rows, key=lambda r: r["tokens"]):
        if row["small_batch_layer_ms"] >= row["grouped_layer_ms"]:
            break
        threshold = row["tokens"]
    return threshold


def merged_entries(grouped: dict[int, MoeConfig], rows: list[dict]) -> dict[int, AnyMoeConfig]:
    """A shape's TUNED entries: the small-batch path's at the M swept up to its threshold, the
    grouped GEMMs' past it, and the grouped config timed at the first M swept past it unless a
    grouped entry already starts at or below that M."""
    threshold = small_batch_threshold(rows)
    entries: dict[int, AnyMoeConfig] = {m: c for m, c in grouped.items() if m > threshold}
    entries |= {row["tokens"]: row["small_batch_config"] for row in rows if row["tokens"] <= threshold}
    above = sorted((row for row in rows if row["tokens"] > threshold), key=lambda r: r["tokens"])
    if threshold and above and not any(threshold < m <= above[0]["tokens"] for m in grouped):
        entries[above[0]["tokens"]] = above[0]["grouped_config"]
    return dict(sorted(entries.items()))


def tuned_grouped(shape: Shape, kind: str) -> dict[int, MoeConfig]:
    """The grouped GEMMs' entries TUNED holds for the shape (none if it is not tuned)."""
    key = (shape.experts, shape.hidden, shape.inter, shape.top_k, dtype_name(weight_dtype(kind)))
    return {m: c for m, c in TUNED.get(key, {}).items() if isinstance(c, MoeConfig)}


def table_line(kind: str, row: dict) -> str:
    """One M: the layer's time tuned (heuristic; the sum of its timed parts), the roofline (HBM,
    matmul) and the tuned time's share of it, and routing."""
    us = {k: v * 1e3 for k, v in row.items() if k.endswith("_ms") and isinstance(v, float)}
    route_us = {k: v * 1e3 for k, v in row["route_ms"].items()}
    return (f"{kind:4s} M={row['tokens']:5d} {row['touched_experts']:3d} experts: {us['layer_ms']:7.1f} us "
            f"(heuristic {us['default_layer_ms']:7.1f}, parts {us['parts_ms']:7.1f}), roofline "
            f"{us['roofline_ms']:6.1f} (HBM {us['memory_ms']:6.1f}, matmul {us['compute_ms']:6.1f}) = "
            f"{100 * us['roofline_ms'] / us['layer_ms']:3.0f}%; route {route_us['triton']:4.1f} us "
            f"(torch {route_us['torch']:4.1f})")


def gemv_line(kind: str, row: dict) -> str:
    """One M: the small-batch layer (its GEMVs' times alone), the grouped one, the faster, and the
    roofline's share of the faster."""
    us = {k: v * 1e3 for k, v in row.items() if k.endswith("_ms") and isinstance(v, float)}
    small, grouped = us["small_batch_layer_ms"], us["grouped_layer_ms"]
    return (f"{kind:4s} M={row['tokens']:3d} {row['touched_experts']:3d} experts: "
            f"small-batch {small:6.1f} us (gate/up {us['gate_up_ms']:5.1f} + down "
            f"{us['down_ms']:5.1f} alone), "
            f"grouped {grouped:6.1f} us -> {'small-batch' if small < grouped else 'grouped    '}; "
            f"roofline {us['roofline_ms']:6.1f} us "
            f"= {100 * us['roofline_ms'] / min(small, grouped):3.0f}%")


def sweep(plan: Plan, kind: str, layers: list[Experts], device: torch.device) -> list[dict]:
    rows = []
    for num_tokens in plan.tokens:
        start = time.perf_counter()
        rows.append(sweep_tokens(plan, layers, num_tokens, device))
        print(f"{table_line(kind, rows[-1])} [{time.perf_counter() - start:.0f} s]", flush=True)
    return rows


def sweep_kind(plan: Plan, kind: str, device: torch.device) -> tuple[list[dict], list[dict], dict | None]:
    """(grouped rows, small-batch rows, the shape's TUNED entries or None) of one kind: the
    small-batch path against the grouped configs the sweep found, or with --small-batch
    against those TUNED holds (no entries if it holds none: a partial table would pin every
    larger M to the last grouped entry)."""
    layers = [make_experts(plan.shape, kind, device) for _ in range(plan.layers)]
    rows = sweep(plan, kind, layers, device)
    grouped = {row["tokens"]: row["best_config"] for row in rows} or tuned_grouped(plan.shape, kind)
    gemv_rows = sweep_small_batch(plan, kind, layers, grouped, device)
    return rows, gemv_rows, merged_entries(grouped, gemv_rows) if grouped else None


def without_configs(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.endswith("config")} for row in rows]


def report_tuned(plan: Plan, kind: str, gemv_rows: list[dict], entries: dict | None) -> str | None:
    """Prints where the small-batch path won; returns the TUNED literal of the kind, if any."""
    if gemv_rows:
        threshold = small_batch_threshold(gemv_rows)
        print(f"{kind}: the small-batch path beat the grouped GEMMs at every M up to {threshold} (of "
              f"{[row['tokens'] for row in gemv_rows]}); for shapes not in TUNED, GEMV_MAX_TOKENS "
              f"(kernels/moe_config.py) is {GEMV_MAX_TOKENS}")
    if entries is None:
        print(f"{kind}: this shape is not in TUNED: run the whole sweep (no --small-batch) for its entries")
        return None
    return tuned_literal(plan.shape, kind, entries)


def run(plan: Plan, kinds: list[str], out_dir: Path, workers: int, write_tuned: bool = False) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    checks = check(plan, {kind: make_experts(plan.shape, kind, device) for kind in kinds}, device)
    report: dict = {"torch": torch.__version__, "triton": triton.__version__, "shape": asdict(plan.shape),
                    "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "checks": checks}
    if not all(c["ok"] for c in checks):
        print("fused_moe does not match its reference: no sweep", file=sys.stderr)
        (out_dir / "moe_sweep.json").write_text(json.dumps(report))
        return 1
    if device.type == "cuda" and workers > 0:
        precompile(plan, kinds, workers)
    results = {kind: sweep_kind(plan, kind, device) for kind in kinds}
    print()
    literals = [report_tuned(plan, kind, gemv_rows, entries)
                for kind, (_, gemv_rows, entries) in results.items()]
    literal = "\n".join(lit for lit in literals if lit)
    if literal:
        print(f"\nTUNED entries for kernels/moe_config.py, to replace those of this shape (measured on "
              f"{report['gpu']}):\n{literal}")
    (out_dir / "moe_tuned.txt").write_text(literal + "\n")
    if write_tuned and literal:
        path = Path(moe_config.__file__)
        path.write_text(paste_tuned(path.read_text(), literal))
        print(f"wrote them into {path}")
    report["sweep"] = {kind: without_configs(rows) for kind, (rows, _, _) in results.items()}
    report["small_batch"] = {kind: without_configs(gemv_rows) for kind, (_, gemv_rows, _) in results.items()}
    (out_dir / "moe_sweep.json").write_text(json.dumps(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="directory for moe_sweep.json and moe_tuned.txt")
    parser.add_argument("--tiny", action="store_true",
                        help="a toy shape and one tiling beside the heuristic's (runs on a CPU)")
    parser.add_argument("--kinds", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    parser.add_argument("--small-batch", action="store_true",
                        help=f"only the small-batch path, against the grouped configs TUNED holds, at "
                             f"M <= {GEMV_SWEEP_MAX} (~3 min)")
    parser.add_argument("--tokens", type=int, nargs="+",
                        help=f"token counts M (default {TOKENS}; the small-batch path at those up to "
                             f"{GEMV_SWEEP_MAX}, by default {GEMV_TOKENS})")
    parser.add_argument("--write-tuned", action="store_true",
                        help="also replace the shape's TUNED entries in kernels/moe_config.py")
    parser.add_argument("--experts", type=int, default=QWEN3_30B_A3B.experts)
    parser.add_argument("--hidden", type=int, default=QWEN3_30B_A3B.hidden)
    parser.add_argument("--intermediate", type=int, default=QWEN3_30B_A3B.inter,
                        help="per tensor-parallel rank (768 / tp for Qwen3-30B-A3B)")
    parser.add_argument("--top-k", type=int, default=QWEN3_30B_A3B.top_k)
    parser.add_argument("--workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                        help="processes compiling the tilings ahead (0: compile as they are timed)")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("the MoE sweep needs a CUDA GPU (or --tiny); none is visible to torch")
    args.out.mkdir(parents=True, exist_ok=True)
    return run(make_plan(args), args.kinds, args.out, args.workers, args.write_tuned)


def make_plan(args: argparse.Namespace) -> Plan:
    if args.tiny:
        tokens = tuple(args.tokens or (1, 5))
        grouped = () if args.small_batch else tokens
        small = tuple(m for m in tokens if m <= GEMV_SWEEP_MAX)
        return Plan(TINY, grouped, grouped, small, small, layers=1, tiny=True)
    shape = Shape(args.experts, args.hidden, args.intermediate, args.top_k)
    gemv_tokens = tuple(m for m in args.tokens if m <= GEMV_SWEEP_MAX) if args.tokens else GEMV_TOKENS
    if args.small_batch:
        return Plan(shape, (), (), gemv_tokens, GEMV_CHECK_TOKENS, LAYERS, tiny=False)
    return Plan(shape, tuple(args.tokens or TOKENS), CHECK_TOKENS, gemv_tokens, GEMV_CHECK_TOKENS,
                LAYERS, tiny=False)


if __name__ == "__main__":
    sys.exit(main())
