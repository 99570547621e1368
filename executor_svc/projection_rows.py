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
against 4.135 / 4.712, and Llama-3.1-8B kept 32 rows (6.497 / 7.063 against 6.503 / 7.062)."""
import statistics
from collections.abc import Callable

import torch
from torch import nn

from pagedserve.executor_svc.cuda_graphs import blas_library
from pagedserve.executor_svc.layers.decoder import CausalLM
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


def time_rows(projections: list[Linear], adds: bool) -> dict[int, float]:
    """Median ms of one pass over `projections` by candidate row count, each GEMM as the layer
    runs it: added into a stream (`adds`, a folded layer) or into an output of its own."""
    passes = {rows: _pass(projections, rows, adds) for rows in CANDIDATES}
    ms: dict[int, list[float]] = {rows: [] for rows in CANDIDATES}
    for _ in range(REPEATS):
        for rows, run in passes.items():
            ms[rows].append(_elapsed_ms(run))
    return {rows: statistics.median(times) for rows, times in ms.items()}


def _pass(projections: list[Linear], rows: int, adds: bool) -> Callable[[], None]:
    weight = projections[0].weight
    inputs = {p.in_features: torch.randn(rows, p.in_features, dtype=weight.dtype, device=weight.device)
              for p in projections}
    outputs = {p.out_features: torch.zeros(rows, p.out_features, dtype=weight.dtype, device=weight.device)
               for p in projections}

    def run() -> None:
        with blas_library(rows):
            for p in projections:
                if adds:
                    add_projection(outputs[p.out_features], inputs[p.in_features], p)
                else:
                    p(inputs[p.in_features])
    run()
    return run


def _elapsed_ms(run: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
