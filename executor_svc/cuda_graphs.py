"""CUDA graphs of pure-decode steps at bucketed batch sizes.

A decode step of n sequences is padded to the next captured size: padding rows carry slot -1 (no
KV write), seq_len 1 and a block-table row of valid block ids, so they read finite KV and their
outputs are never sampled. Each graph reads the first rows of the persistent StepBuffers, with
the attention launch configuration fixed at capture (max_seq_len = max_model_len and the KV
split count of its size)."""
import bisect
import time

import torch

from pagedserve.executor_svc.attention_backend import AttentionMetadata
from pagedserve.executor_svc.kv_cache import KVCache
from pagedserve.executor_svc.layers.decoder import CausalLM
from pagedserve.executor_svc.step_buffers import StepBuffers
from pagedserve.kernels.attention import default_num_splits
from pagedserve.common.log import get_logger

log = get_logger(__name__)

# vLLM's default: larger decode batches are compute-bound enough that launch gaps don't matter.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every 8 to 256, then every 16, up to max_num_seqs (capped at 512)."""
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, MAX_CAPTURE_SIZE + 1, 16)]
    return [s for s in sizes if s < cap] + [cap]


def bucket(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest size that holds num_seqs, or None when the step is too large for a graph."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def decode_metadata(buffers: StepBuffers, size: int, max_model_len: int, num_heads: int,
                    num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    kv_dtype: torch.dtype) -> AttentionMetadata:
    """The metadata of a padded decode step of `size` rows, with a launch configuration that does
    not depend on the step's values."""
    num_splits = default_num_splits(size, size, num_heads, num_kv_heads, head_dim,
                                    dtype.itemsize, 1, max_model_len, buffers.input_ids.device,
                                    kv_bytes=kv_dtype.itemsize)
    return AttentionMetadata(slot_mapping=buffers.slot_mapping[:size],
                             query_start_loc=buffers.decode_query_start_loc[:size + 1],
                             seq_lens=buffers.seq_lens[:size],
                             block_tables=buffers.block_tables[:size], max_query_len=1,
                             max_seq_len=max_model_len, num_splits=num_splits)


class CudaGraphs:
    """One captured decode forward per size; `replay(size)` returns its hidden states [size, H]."""

    def __init__(self, model: CausalLM, buffers: StepBuffers,
                 metas: dict[int, AttentionMetadata]) -> None:
        self.model = model
        self.buffers = buffers
        self.metas = metas
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fill_padding(self, size: int) -> None:
        """Makes the first `size` rows of the buffers padding rows."""
        b = self.buffers
        b.input_ids[:size].zero_()
        b.positions[:size].zero_()
        b.slot_mapping[:size].fill_(-1)
        b.seq_lens[:size].fill_(1)

    def forward(self, size: int, kv_caches: list[KVCache]) -> torch.Tensor:
        """The eager forward that `replay(size)` repeats."""
        b = self.buffers
        return self.model(b.input_ids[:size], b.positions[:size], kv_caches, self.metas[size])

    def capture(self, kv_caches: list[KVCache]) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        self.fill_padding(max(self.metas))
        # Largest first: the smaller graphs then fit in the memory pool the largest one left.
        for size in sorted(self.metas, reverse=True):
            # Compiles the Triton kernels and lets cuBLAS pick its algorithms outside the capture.
            self.forward(size, kv_caches)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(size, kv_caches)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        log.info("cuda_graphs_captured", sizes=len(self.graphs), largest=max(self.graphs),
                 seconds=round(time.perf_counter() - start, 2),
                 memory_gib=round((free_before - torch.cuda.mem_get_info()[0]) / 2**30, 3))

    def replay(self, size: int) -> torch.Tensor:
        graph, out = self.graphs[size]
        graph.replay()
        return out
