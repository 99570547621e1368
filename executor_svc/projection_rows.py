"""The rows o_proj and down_proj run a step of up to PROJECTION_ROWS tokens on, measured once per
model on its GPU (layers/linear.py's input_rows reads each projection's `min_rows`).

cuBLASLt picks a GEMM's kernel by its shape, and at 32 rows it splits some projections' K over a
reduction kernel of its own where at 64 rows it does not. On an H100 (2026-12-05, `python -m
pagedserve.bench.gemm_sweep`, us a GEMM at 32 / 64 rows under cuBLASLt) down_proj took 54.03 / 51.84
for the Qwen2.5-7B shape and 25.48 / 22.67 for Phi-4-mini's (split at 32 rows both), but 44.29 /
44.92 for Llama-3.1-8B's (split at neither). A decode step at 16 / 32 rows on 64-row buffers took
5.908 / 6.203 ms against 6.016 / 6.323 (Qwen2.5-7B), 4.028 / 4.603 against 4.144 / 4.720 (Phi-4-mini)
and 6.534 / 7.113 against 6.523 / 7.092 (Llama-3.1-8B). So the worker times the model's own
projections at both row counts and keeps 32 unless 64 is faster by MIN_GAIN. With it, at 16 / 32
rows, Qwen2.5-7B's step took 5.885 / 6.197 ms against 5.972 / 6.297, Phi-4-mini's 4.014 / 4.591
against 4.135 / 4.712, and Llama-3.1-8B kept 32 rows (6.497 / 7.063 against 6.503 / 7.062).

The same timing picks the decode graph sizes worth capturing past LEAST_PRUNED rows (see there)."""
import statistics
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pagedserve.executor_svc.cuda_graphs import blas_library
from pagedserve.executor_svc.fp8 import Fp8Linear
from pagedserve.executor_svc.layers.decoder import CausalLM
from pagedserve.executor_svc.layers.mlp import GatedMLP
from pagedserve.executor_svc.layers.linear import PROJECTION_ROWS, Linear, MergedLinear, add_projection
from pagedserve.executor_svc.parallel import TensorParallel
from pagedserve.common.log import get_logger

log = get_logger(__name__)

CANDIDATES = (PROJECTION_ROWS, 64)
# A pass's 64-row / 32-row ratio moved by up to 2% between starts of one model (H100, the worker's
# own log): Qwen2.5-7B 0.953 and 0.972, Phi-4-mini 0.901 and 0.929, Llama-3.1-8B 1.022, 1.014, 1.016
# and, once, 0.985. The margin keeps such a near tie on 32 rows, which costs what it cost before.
MIN_GAIN = 0.02
REPEATS = 10
# Past 128 rows a decode step's GEMMs are compute-bound and cuBLASLt picks each one's tiles by its
# shape, some of them poorly. On an H100 (2026-12-07, Llama-3.1-8B shape, 8 distinct weights a
# GEMM in one CUDA graph, us for a layer's four projections) FP8 ones took 211.0 at 400 rows,
# 207.6 at 416, 195.0 at 448, but 185.2 at 512 (gate_up 118.9 at 400 against 96.7 at 512); bf16
# ones 265.2 at 288 against 240.0 at 304, 448.6 at 448 against 336.8 at 464 (gate_up 291.2 against
# 183.0). A decode graph of such a size costs more than a larger one, whose padding rows add only
# their share of the norms and activations (attention reads one key for each): it is left out and
# its steps pad to the next size captured. Up to 128 rows the projections read their weights at
# about the same time for any rows, and PROJECTION_ROWS and FUSED_ROWS choose their rows. With the
# sizes left out (H100, `bench latency --input-len 500 --output-len 48`, mean decode step) bf16 at
# batch 448 took 23.2 ms against 27.2 (twice), FP8 + FP8 KV at 400 14.10 against 14.64.
LEAST_PRUNED = 129


def row_projections(model: nn.Module) -> list[Linear]:
    """The projections that run small steps on min_rows rows: the row-parallel ones."""
    return [m for m in model.modules() if isinstance(m, Linear) and not isinstance(m, MergedLinear)]


def choose(model: CausalLM, tp: TensorParallel | None) -> None:
    """Sets every row-parallel projection's min_rows to the faster candidate on this GPU (every
    rank the same: their all-reduces must agree on the rows)."""
    projections = row_projections(model)
    if not projections:
        return
    ms = time_rows(projections, model.model.layers[0].folded)
    rows = pick(ms) if tp is None else tp.min(pick(ms))
    for projection in projections:
        projection.min_rows = rows
    log.info("projection_rows_chosen", rows=rows, pass_ms={n: round(t, 4) for n, t in ms.items()})


def pick(ms: dict[int, float]) -> int:
    """PROJECTION_ROWS, unless another candidate's pass is MIN_GAIN faster."""
    best = min(ms, key=ms.get)
    return best if ms[best] < ms[PROJECTION_ROWS] * (1 - MIN_GAIN) else PROJECTION_ROWS


def decode_sizes(model: CausalLM, sizes: list[int]) -> list[int]:
    """The decode graph sizes to capture on this GPU: `sizes` less those from LEAST_PRUNED rows up
    that a larger size's pass over a layer's projections beats by MIN_GAIN. A model with any
    mixture-of-experts layer keeps every size: its padding rows would cost expert GEMMs."""
    layers = model.model.layers
    timed = [size for size in sizes if size >= LEAST_PRUNED]
    if not (timed and all(isinstance(layer.mlp, GatedMLP) for layer in layers)):
        return sizes
    layer = layers[0]
    projections = [m for m in layer.modules() if isinstance(m, (Linear, Fp8Linear))]
    ms = time_rows(projections, layer.folded, timed)
    beaten = outrun(ms)
    log.info("decode_sizes_chosen", left_out=beaten, pass_us={n: round(t * 1000, 1) for n, t in ms.items()})
    return [size for size in sizes if size not in beaten]


def outrun(ms: dict[int, float]) -> list[int]:
    """The row counts whose pass a larger row count's beats by MIN_GAIN."""
    return [rows for rows in ms if any(ms[more] < ms[rows] * (1 - MIN_GAIN) for more in ms if more > rows)]


def time_rows(projections: list[nn.Module], adds: bool, candidates: Sequence[int] = CANDIDATES) -> dict[int, float]:
    """Median ms of one pass over `projections` by candidate row count, each GEMM as the layer
    runs it: a folded layer's (`adds`) row-parallel ones added into a stream, the others into an
    output of their own."""
    first = projections[0]
    dtype = first.dtype if isinstance(first, Fp8Linear) else first.weight.dtype
    most, device = max(candidates), first.weight.device
    inputs = {p.in_features: torch.randn(most, p.in_features, dtype=dtype, device=device) for p in projections}
    outputs = {p.out_features: torch.zeros(most, p.out_features, dtype=dtype, device=device) for p in projections}
    pool = torch.cuda.graph_pool_handle()
    passes = {rows: _captured(_pass(projections, adds, rows, inputs, outputs), pool) for rows in candidates}
    ms: dict[int, list[float]] = {rows: [] for rows in candidates}
    for _ in range(REPEATS):
        for rows, run in passes.items():
            ms[rows].append(_elapsed_ms(run))
    return {rows: statistics.median(times) for rows, times in ms.items()}


def _pass(projections: list[nn.Module], adds: bool, rows: int, inputs: dict[int, torch.Tensor],
          outputs: dict[int, torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        with blas_library(rows):
            for p in projections:
                if adds and not isinstance(p, MergedLinear):
                    add_projection(outputs[p.out_features][:rows], inputs[p.in_features][:rows], p)
                else:
                    p(inputs[p.in_features][:rows])
    run()
    return run


# Replayed from a CUDA graph, as steps replay their projections: run eagerly, an FP8 pass's host
# work (quantizing, picking each GEMM's kernel) outlasted its 120-210 us of GEMMs on an H100, and
# its timings measured the host.
def _captured(run: Callable[[], None], pool: tuple) -> Callable[[], None]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph.replay


def _elapsed_ms(run: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
