"""A decode step's projections on one GPU, under cuBLAS and cuBLASLt, at several row counts: which
library is faster for each projection of a model shape, and which GEMMs split over K into a
reduction kernel of their own (a decode profile's "gemm split-k sum").

Run as `python -m pagedserve.bench.gemm_sweep [SHAPE ...] [--rows 16,32,64]` (the dense shapes of
`pagedserve make-shape-model`; default llama-3.1-8b); prints a line a shape, projection, row count
and library, then a layer's projections summed by row count and library, then one JSON line with
every number. Each projection runs as a folded decoder layer runs it (layers/decoder.py's
fold_norms): qkv and gate_up as x @ W.T, o_proj and down_proj added into the residual stream
(layers/linear.py's add_projection). LAYERS distinct weights replay in one CUDA graph, so that
they are read from memory rather than L2, timed as the median replay (bench/timing.py), in us a
GEMM; the kernels are those of one eager call, named by torch's profiler.
"""
import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from pagedserve.bench.step_profile import cuda_kernels, kind
from pagedserve.bench.timing import graph_ms
from pagedserve.common.model_shapes import SHAPES
from pagedserve.executor_svc.cuda_graphs import preferred_blas
from pagedserve.executor_svc.model_config import ModelConfig, model_config_from_dict

LAYERS = 8
LIBRARIES = ("cublas", "cublaslt")
# Decoders of dense gated MLPs: a mixture of experts' or an encoder's layers hold other GEMMs.
DENSE = [name for name, config in SHAPES.items()
         if config["architectures"][0].endswith("ForCausalLM") and "num_experts" not in config]


@dataclass(slots=True)
class Projection:
    name: str
    in_features: int
    out_features: int
    adds: bool  # added into the residual stream, as o_proj and down_proj are when folded


def projections(config: ModelConfig) -> list[Projection]:
    """A decoder layer's four projections, as an unsharded model holds them."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return [Projection("qkv_proj", hidden, q + 2 * kv, False),
            Projection("o_proj", q, hidden, True),
            Projection("gate_up_proj", hidden, 2 * inner, False),
            Projection("down_proj", inner, hidden, True)]


def gemms(projection: Projection, rows: int, layers: int) -> Callable[[], None]:
    """`layers` GEMMs of `rows` rows, each through a distinct weight."""
    weights = [torch.randn(projection.out_features, projection.in_features, dtype=torch.bfloat16,
                           device="cuda") * projection.in_features ** -0.5 for _ in range(layers)]
    x = torch.randn(rows, projection.in_features, dtype=torch.bfloat16, device="cuda")
    stream = torch.zeros(rows, projection.out_features, dtype=torch.bfloat16, device="cuda")

    def run() -> None:
        for weight in weights:
            if projection.adds:
                stream.addmm_(x, weight.t())
            else:
                torch.nn.functional.linear(x, weight)
    return run


def kernel_names(fn: Callable[[], None]) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [kernel.name for kernel in cuda_kernels(prof)]


def sweep_shape(name: str, rows: list[int]) -> dict:
    """{projection: {rows: {library: {"us": us a GEMM, "kernels": [...], "split_k": bool}}}}."""
    out: dict = {}
    for projection in projections(model_config_from_dict(SHAPES[name])):
        for count in rows:
            for library in LIBRARIES:
                with preferred_blas(library):
                    names = kernel_names(gemms(projection, count, 1))
                    us = graph_ms(gemms(projection, count, LAYERS)) * 1e3 / LAYERS
                torch.cuda.empty_cache()
                split = any(kind(n) == "gemm split-k sum" for n in names)
                out.setdefault(projection.name, {}).setdefault(count, {})[library] = {
                    "us": round(us, 2), "kernels": names, "split_k": split}
                print(f"{name:12s} {projection.name:12s} {count:4d} rows {library:8s} {us:8.2f} us"
                      f"{'  split-K' if split else ''}  {', '.join(n[:60] for n in names)}",
                      flush=True)
    return out


def layer_us(sweep: dict) -> dict[int, dict[str, float]]:
    """A decoder layer's projections summed, us by row count and library, from sweep_shape's result:
    what picks a library or a padded row count for a whole step."""
    out: dict[int, dict[str, float]] = {}
    for by_rows in sweep.values():
        for rows, by_library in by_rows.items():
            sums = out.setdefault(rows, {})
            for library, result in by_library.items():
                sums[library] = sums.get(library, 0.0) + result["us"]
    return {rows: {library: round(us, 2) for library, us in sums.items()} for rows, sums in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.bench.gemm_sweep")
    parser.add_argument("shapes", nargs="*", metavar="SHAPE",
                        help=f"model shapes (default llama-3.1-8b): {', '.join(DENSE)}")
    parser.add_argument("--rows", default="16,32,64", help="row counts, comma-separated")
    args = parser.parse_args()
    names = args.shapes or ["llama-3.1-8b"]
    unknown = [n for n in names if n not in DENSE]
    if unknown:
        sys.exit(f"unknown or not a dense decoder: {', '.join(unknown)}; choose from "
                 f"{', '.join(DENSE)}.")
    if not torch.cuda.is_available():
        sys.exit("gemm_sweep needs a CUDA GPU; none is visible to torch.")
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    results = {name: sweep_shape(name, rows) for name in names}
    layers = {name: layer_us(sweep) for name, sweep in results.items()}
    for name, by_rows in layers.items():
        for count, by_library in by_rows.items():
            print(f"{name:12s} a layer      {count:4d} rows " + "  ".join(
                f"{library} {us:8.2f} us" for library, us in by_library.items()))
    print(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                      "gpu": torch.cuda.get_device_name(), "layers": LAYERS,
                      "gemm_sweep": results, "layer_us": layers}))


if __name__ == "__main__":
    main()
