"""Decode-attention tilings on one GPU, over bf16 and fp8 KV caches.

Run as `python -m pagedserve.bench.decode_sweep [CASE ...]` (default: every case of CASES); prints
a line a case and cache, then one JSON line with every number. Each tiling of TILINGS and the
default one attend LAYERS layers of distinct caches in one CUDA graph, so that the cache is read
from memory rather than L2, timed as the median replay (bench/timing.py), in us a layer. A
tiling whose output differs from the default's by more than MAX_ABS_ERR is reported, not timed.
Shapes are Llama-3.1-8B attention (bench/kernels.py); each row's context is drawn from its case's
range and its blocks are shuffled over the cache.
"""
import itertools
import json
import sys
from collections.abc import Callable

import torch
import triton

from pagedserve.bench.kernels import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, SCALE
from pagedserve.bench.timing import graph_ms
from pagedserve.kernels.attention import AttentionConfig, paged_attention
from pagedserve.kernels.reference import FP8_DTYPE

# Decode rows x (least, most) context: the offline `mixed` batch, long and short contexts, and
# the 16-42 rows of an online server at 10-50 streams.
CASES = {"512xU150-1100": (512, 150, 1100), "256x1024": (256, 1024, 1024), "64x4096": (64, 4096, 4096),
         "42xU400-1000": (42, 400, 1000), "32x600": (32, 600, 600), "16x600": (16, 600, 600)}
LAYERS = 8
MAX_ABS_ERR = 2e-2
# The decode tiling's shape (16 rows, keys loaded transposed, one masked loop) at each KV tile,
# stage count and warp count.
TILINGS = {f"t{tile}_s{stages}_w{warps}": AttentionConfig(16, tile, warps, stages, k_transposed=True,
                                                          one_loop=True)
           for tile, stages, warps in itertools.product((64, 128, 256), (2, 3), (4, 8))}


def case_tables(batch: int, least: int, most: int,
                device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, int]:
    """(seq_lens, block_tables, blocks in all) for `batch` rows of contexts U[least, most], each
    block of the cache in exactly one row, in shuffled order."""
    lens = torch.randint(least, most + 1, (batch,))
    blocks = -(-lens // BLOCK_SIZE)
    order = torch.randperm(int(blocks.sum()), dtype=torch.int32)
    table = torch.zeros(batch, int(blocks.max()), dtype=torch.int32)
    for row, (start, count) in enumerate(zip((blocks.cumsum(0) - blocks).tolist(), blocks.tolist())):
        table[row, :count] = order[start:start + count]
    return lens.int().to(device), table.to(device), len(order)


def layer_us(fn: Callable[[], None]) -> float:
    """us a layer of fn (LAYERS launches) replayed from a CUDA graph."""
    return graph_ms(fn) * 1e3 / LAYERS


def sweep_case(batch: int, least: int, most: int, fp8: bool) -> dict:
    """The default tiling's time, then each of TILINGS' (or why it was not timed)."""
    lens, table, num_blocks = case_tables(batch, least, most)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    ones = torch.ones((), device="cuda")
    out = torch.empty_like(q)
    dtype = FP8_DTYPE if fp8 else torch.bfloat16

    def cache() -> torch.Tensor:
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        return torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(dtype)

    caches = [(cache(), cache()) for _ in range(LAYERS)]

    def layers(config: AttentionConfig | None) -> Callable[[], None]:
        def run() -> None:
            for k_cache, v_cache in caches:
                paged_attention(q, k_cache, v_cache, table, lens, starts, SCALE, max_query_len=1,
                                max_seq_len=most, out=out, kv_scales=(ones, ones), config=config)
        return run

    layers(None)()
    expected = out.float()
    row: dict = {"default": layer_us(layers(None))}
    for name, config in TILINGS.items():
        try:
            out.fill_(float("nan"))
            layers(config)()
            err = (out.float() - expected).abs().max().item()
            timed = err <= MAX_ABS_ERR
            row[name] = layer_us(layers(config)) if timed else f"max abs err {err:.2e}, not timed"
        except Exception as failure:  # a tiling the compiler or the GPU refuses: report, go on
            row[name] = f"{type(failure).__name__}: {str(failure).splitlines()[0][:120]}"
    return row


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    if not torch.cuda.is_available():
        sys.exit("decode_sweep needs a CUDA GPU; none is visible to torch.")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}.")
    torch.manual_seed(0)
    results = {}
    for name in names:
        for cache in ("bf16", "fp8"):
            row = sweep_case(*CASES[name], fp8=cache == "fp8")
            torch.cuda.empty_cache()
            results[f"{name} {cache}"] = row
            timed = {k: v for k, v in row.items() if isinstance(v, float)}
            best = min(timed, key=timed.get)
            print(f"{name:14s} {cache:4s} default {row['default']:7.2f} us a layer, best {best} "
                  f"{timed[best]:7.2f}", flush=True)
        bf16, fp8 = results[f"{name} bf16"]["default"], results[f"{name} fp8"]["default"]
        print(f"{name:14s} fp8 / bf16, default tilings: {fp8 / bf16:.3f}", flush=True)
    print(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                      "gpu": torch.cuda.get_device_name(), "layers": LAYERS, "decode_sweep": results}))


if __name__ == "__main__":
    main()
