"""GPU timings the kernel benchmarks share; each also runs, once and timed on the host, without a
GPU, so that a benchmark's --tiny path runs on a CPU."""
import time
from collections.abc import Callable

import torch
import triton.testing


def median_ms(fn: Callable[[], object], warmup_ms: int = 2, rep_ms: int = 10) -> float:
    """fn's median time, ms, over triton's do_bench (warmup_ms, then rep_ms of calls)."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def graph_ms(fn: Callable[[], object]) -> float:
    """fn's time replayed from a CUDA graph (once, timed on the host, without a GPU)."""
    if not torch.cuda.is_available():
        return median_ms(fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = median_ms(graph.replay)
    del graph
    return ms
