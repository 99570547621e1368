"""CUDA graphs of whole steps at bucketed shapes (num_tokens, num_seqs).

A decode step of n sequences is padded to the next captured size: padding rows carry slot -1 (no
KV write), seq_len 1 and a block-table row of valid block ids, so they read finite KV and their
outputs are never sampled. A mixed step (prompt chunks, with or without decode rows) of up to
MAX_MIXED_TOKENS tokens is padded to the next captured token count T and to min(T, max_num_seqs)
+ 1 sequences: empty sequences, then one that owns the padding tokens as a prompt without
context (slot -1). The attention kernel finds each query block's sequence on the device, so one
graph serves every split of T tokens into sequences. Each graph reads the first rows of the
persistent StepBuffers, with the attention launch configuration fixed at capture
(max_query_len, max_seq_len = max_model_len and the KV split count of its shape)."""
import bisect
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedserve.executor_svc.attention_backend import AttentionMetadata
from pagedserve.executor_svc.kv_cache import KVCache
from pagedserve.executor_svc.layers.decoder import CausalLM
from pagedserve.executor_svc.lora import LoraSwitch
from pagedserve.executor_svc.step_buffers import StepBuffers
from pagedserve.kernels.attention import default_num_splits
from pagedserve.common.log import get_logger

log = get_logger(__name__)

# vLLM's default: larger decode batches are compute-bound enough that launch gaps don't matter.
MAX_CAPTURE_SIZE = 512
# Eagerly, a step that computes any prompt token pays its ~450 launches on the host: on an H200
# (Llama-3.1-8B shape) such steps beside a few dozen decode rows took about 25 ms where a decode
# graph of the rows took 6 ms. Past 512 tokens the step's arithmetic hides the launches. With these
# graphs `bench serve --concurrency 10,...,50` gave 1.6-8.7% more output tokens/s than the same tree
# with mixed steps eager (4,667 against 4,292 at 50), TPOT 9.3 against 10.3 ms at 50.
MAX_MIXED_TOKENS = 512
# A mixed graph's attention launch is unsplit, as prompt chunks' q blocks fill the GPU, except in
# graphs of at most MIXED_SPLIT_TOKENS tokens: a few prompt tokens beside decode rows (a prompt's
# last chunk, a batch's background chunk), where the decode rows' whole contexts are the longest
# chains, which MIXED_SPLITS KV segments cut as a decode graph's do. Device ms a step in
# `bench serve --dataset mixed` on an H200 (Llama-3.1-8B shape, 2026-12-04), unsplit against 4
# segments: 9 decode rows in a 32-token graph 5.91 / 5.45 (their decode graph: 5.10), in a 64-token
# one 6.06 / 5.78, 96: 6.30 / 6.22, 128: 6.65 / 6.88, 256: 8.30 / 9.16; 28 rows in a 64-token graph
# 6.39 / 6.23, 48 rows 6.74 / 6.78. 2 segments gained less (5.70 and 6.01 at 32 and 64 tokens).
# Beside a batch, whose background chunks make such graphs most steps, `bench batch` gave TPOT
# 1.146x the load alone and 45.0% of the capacity left, against 1.171x and 42.5% unsplit in another
# device call (calls differ by about 2%).
MIXED_SPLIT_TOKENS = 64
MIXED_SPLITS = 4
# cuBLASLt's heuristics pick faster GEMMs than cuBLAS's default ones from 32 to 96 rows. On an H200
# (Llama-3.1-8B shape, 32 distinct weights a projection in one CUDA graph, 2026-12-04), us a layer
# for qkv + o + gate_up + down, cuBLAS / cuBLASLt: 32 rows 120.5 / 117.5, 48 125.2 / 121.5, 64
# 126.7 / 120.5, 96 132.0 / 125.1 (o_proj 13.6 / 12.1 at 48 rows, down_proj 37.0 / 32.9 at 96),
# equal or faster for every projection; at 128 rows cuBLAS's down_proj was the faster (36.9 /
# 38.7). So graphs of this many tokens are captured with cuBLASLt preferred. Beside a batch, whose
# steps are mostly mixed graphs of 32-64 tokens, `bench batch` gave the interactive TPOT 6.07 ms
# against 6.21 with cuBLAS alone, in one device call; `bench serve --concurrency 10,30,50` moved by
# under 0.4% (its mixed steps are mostly 256-token ones). Smaller graphs are too: their o_proj and
# down_proj read buffers of 32 rows or more (layers/linear.py's input_rows), and their qkv and gate_up
# took the same time under either library (15.64 / 15.61 and 55.89 / 55.87 us at 16 rows).
LT_TOKENS = range(1, 97)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every 8 to 256, then every 16, up to max_num_seqs (capped at 512)."""
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, MAX_CAPTURE_SIZE + 1, 16)]
    return [s for s in sizes if s < cap] + [cap]


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts of mixed-step graphs: every 32 to 256, then every 64, up to
    max_num_batched_tokens (capped at MAX_MIXED_TOKENS)."""
    cap = min(max_num_batched_tokens, MAX_MIXED_TOKENS)
    sizes = [*range(32, 257, 32), *range(320, MAX_MIXED_TOKENS + 1, 64)]
    return [s for s in sizes if s < cap] + [cap]


def pads_mixed_steps(device: torch.device) -> bool:
    """Mixed steps are padded only where graphs replay them: elsewhere the padding tokens would
    be arithmetic for nothing (decode steps, whose padding is a few rows, pad everywhere)."""
    return device.type == "cuda"


class GraphShape(NamedTuple):
    """A padded step: num_tokens tokens of num_seqs sequences, mixed or pure decode."""
    num_tokens: int
    num_seqs: int
    mixed: bool


@dataclass(slots=True)
class GraphShapes:
    """The padded step shapes that graphs replay (see the module doc)."""
    decode: list[int]
    mixed: list[int]
    max_num_seqs: int

    def shape(self, num_tokens: int, num_seqs: int) -> GraphShape | None:
        """The shape a step of num_tokens tokens of num_seqs sequences pads to, or None when it
        runs eagerly."""
        if num_tokens == num_seqs:
            size = bucket(self.decode, num_seqs)
            return None if size is None else GraphShape(size, size, False)
        tokens = bucket(self.mixed, num_tokens)
        if tokens is None:
            return None
        shape = self._mixed(tokens)
        return shape if num_seqs < shape.num_seqs else None

    def all(self) -> list[GraphShape]:
        return ([GraphShape(size, size, False) for size in self.decode]
                + [self._mixed(tokens) for tokens in self.mixed])

    def largest(self) -> list[GraphShape]:
        """The largest decode shape and the largest mixed one, where there are any."""
        decode = [GraphShape(size, size, False) for size in self.decode[-1:]]
        return decode + [self._mixed(tokens) for tokens in self.mixed[-1:]]

    def _mixed(self, num_tokens: int) -> GraphShape:
        return GraphShape(num_tokens, min(num_tokens, self.max_num_seqs) + 1, True)


def bucket(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest size that holds num_seqs, or None when the step is too large for a graph."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def graph_metadata(buffers: StepBuffers, shape: GraphShape, max_model_len: int,
                   num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   kv_dtype: torch.dtype) -> AttentionMetadata:
    """The metadata of a step padded to `shape`, with a launch configuration that does not depend
    on the step's values."""
    num_tokens, num_seqs, mixed = shape
    if not mixed:
        return _decode_metadata(buffers, num_seqs, max_model_len, num_heads, num_kv_heads,
                                head_dim, dtype, kv_dtype)
    # At most MAX_MIXED_TOKENS tokens attend in one launch of small tiles (kernels/attention.py).
    return AttentionMetadata(slot_mapping=buffers.slot_mapping[:num_tokens],
                             query_start_loc=buffers.query_start_loc[:num_seqs + 1],
                             seq_lens=buffers.seq_lens[:num_seqs],
                             block_tables=buffers.block_tables[:num_seqs],
                             max_query_len=num_tokens, max_seq_len=max_model_len,
                             num_splits=MIXED_SPLITS if num_tokens <= MIXED_SPLIT_TOKENS else 1)


def _decode_metadata(buffers: StepBuffers, size: int, max_model_len: int, num_heads: int,
                     num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     kv_dtype: torch.dtype) -> AttentionMetadata:
    num_splits = default_num_splits(size, size, num_heads, num_kv_heads, head_dim,
                                    dtype.itemsize, 1, max_model_len, buffers.input_ids.device,
                                    kv_bytes=kv_dtype.itemsize)
    return AttentionMetadata(slot_mapping=buffers.slot_mapping[:size],
                             query_start_loc=buffers.decode_query_start_loc[:size + 1],
                             seq_lens=buffers.seq_lens[:size],
                             block_tables=buffers.block_tables[:size], max_query_len=1,
                             max_seq_len=max_model_len, num_splits=num_splits)


def blas_library(num_tokens: int) -> contextlib.AbstractContextManager:
    """Prefers cuBLASLt for the GEMMs of a step of num_tokens tokens in LT_TOKENS (cuBLAS's
    default choice otherwise) while it lasts; nothing where torch has no CUDA."""
    lt = num_tokens in LT_TOKENS and torch.backends.cuda.is_built()
    return preferred_blas("cublaslt") if lt else contextlib.nullcontext()


@contextlib.contextmanager
def preferred_blas(library: str) -> Iterator[None]:
    """Prefers `library` ("cublas" or "cublaslt") for the GEMMs torch runs while it lasts."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


class CudaGraphs:
    """One captured forward per padded shape; `replay(shape)` returns its hidden states
    [num_tokens, H]."""

    def __init__(self, model: CausalLM, buffers: StepBuffers,
                 metas: dict[GraphShape, AttentionMetadata]) -> None:
        self.model = model
        self.buffers = buffers
        self.metas = metas
        self.graphs: dict[GraphShape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Under --enable-lora (set by ModelRunner.use_lora): the same shapes captured once more
        # without the LoRA deltas, which a step without adapters replays.
        self.lora: LoraSwitch | None = None
        self.base_graphs: dict[GraphShape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fill_padding(self, shape: GraphShape) -> None:
        """Makes the first rows of the buffers a step of `shape` that is all padding."""
        b, num_tokens, num_seqs = self.buffers, shape.num_tokens, shape.num_seqs
        b.input_ids[:num_tokens].zero_()
        b.positions[:num_tokens].zero_()
        b.slot_mapping[:num_tokens].fill_(-1)
        # Block 0 only: the profiling step measures a graph's forward on a one-block cache.
        b.block_tables[:num_seqs].zero_()
        if not shape.mixed:
            b.seq_lens[:num_seqs].fill_(1)
            return
        b.seq_lens[:num_seqs].zero_()
        b.seq_lens[num_seqs - 1] = num_tokens
        b.query_start_loc[:num_seqs].zero_()
        b.query_start_loc[num_seqs] = num_tokens

    def forward(self, shape: GraphShape, kv_caches: list[KVCache]) -> torch.Tensor:
        """The eager forward that `replay(shape)` repeats."""
        b, num_tokens = self.buffers, shape.num_tokens
        return self.model(b.input_ids[:num_tokens], b.positions[:num_tokens], kv_caches,
                          self.metas[shape])

    def capture(self, kv_caches: list[KVCache]) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        if self.lora is not None:
            self.lora.on = False
            self._capture_all(self.base_graphs, kv_caches, pool)
            self.lora.on = True
        self._capture_all(self.graphs, kv_caches, pool)
        torch.cuda.synchronize()
        log.info("cuda_graphs_captured", shapes=len(self.graphs),
                 largest=max(self.graphs).num_tokens,
                 seconds=round(time.perf_counter() - start, 2),
                 memory_gib=round((free_before - torch.cuda.mem_get_info()[0]) / 2**30, 3))

    def _capture_all(self, graphs: dict, kv_caches: list[KVCache], pool: tuple) -> None:
        # Largest first: the smaller graphs then fit in the memory pool the largest one left.
        for shape in sorted(self.metas, reverse=True):
            self.fill_padding(shape)
            with blas_library(shape.num_tokens):
                # Compiles the Triton kernels and lets the BLAS library pick its algorithms
                # outside the capture.
                self.forward(shape, kv_caches)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(shape, kv_caches)
            graphs[shape] = (graph, out)

    def mixed_tokens(self) -> int:
        """The token count of the largest mixed step captured (0: none)."""
        return max((shape.num_tokens for shape in self.graphs if shape.mixed), default=0)

    def replay(self, shape: GraphShape) -> torch.Tensor:
        graphs = self.base_graphs if self.lora is not None and not self.lora.on else self.graphs
        graph, out = graphs[shape]
        graph.replay()
        return out
