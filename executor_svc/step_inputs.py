"""A step's forward inputs as the host builds them from the persistent batch: token ids,
positions, KV slots, sequence lengths, the rows that sample, and the padding to a CUDA graph's
shape (cuda_graphs.py). Pure numpy; the runner uploads them."""
from dataclasses import dataclass

import numpy as np

from pagedserve.executor_svc.cuda_graphs import GraphShape, GraphShapes
from pagedserve.executor_svc.input_batch import InputBatch


@dataclass(slots=True)
class HostInputs:
    """One step's inputs as the host builds them, padded to its graph shape if it has one."""
    rows: np.ndarray                     # [num_seqs] persistent-batch rows (padding: row 0)
    input_ids: np.ndarray                # [num_tokens]
    # [2, n] (token index, row): tokens that steps in flight sample, filled in on the device.
    late: np.ndarray | None
    positions: np.ndarray                # [num_tokens]
    slot_mapping: np.ndarray             # [num_tokens]
    seq_lens: np.ndarray                 # [num_seqs]
    query_lens: np.ndarray               # [num_seqs], unpadded
    query_start_loc: np.ndarray          # [num_seqs + 1]
    # The hidden-state rows to sample; None when they are the first len(sample_rows) rows.
    logits_indices: np.ndarray | None
    sample_rows: np.ndarray
    graph: GraphShape | None


def host_inputs(batch: InputBatch, rows: np.ndarray, query_lens: np.ndarray, shapes: GraphShapes,
                max_model_len: int) -> HostInputs:
    """The inputs of a step computing query_lens tokens of each of `rows` from its num_computed
    on, padded to the graph shape that holds it if there is one."""
    block_size = batch.block_size
    computed = batch.num_computed[rows]
    seq_lens = computed + query_lens
    known = batch.known_tokens(rows)
    _check_lengths(batch, rows, seq_lens, known, max_model_len)
    num_seqs, num_tokens = len(rows), int(query_lens.sum())
    graph = shapes.shape(num_tokens, num_seqs)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    if num_tokens != num_seqs:
        token_rows = np.repeat(rows, query_lens)
        positions = (np.arange(num_tokens)
                     - np.repeat(query_start_loc[:-1] - computed, query_lens))
    else:
        token_rows, positions = rows, computed
    input_ids = batch.token_ids[token_rows, positions]
    # Tokens sampled by steps still in flight: the device fills them in from last_sampled.
    late = np.flatnonzero(positions >= batch.num_tokens[token_rows])
    late = np.stack((late, token_rows[late])) if len(late) else None
    slot_mapping = (batch.block_table[token_rows, positions // block_size] * block_size
                    + positions % block_size)
    sample_rows = np.flatnonzero(seq_lens == known)
    # One token per sequence, all sampling: the logits rows are the first hidden-state rows.
    logits_indices = (None if num_tokens == num_seqs == len(sample_rows)
                      else query_start_loc[1:][sample_rows] - 1)
    host = HostInputs(rows, input_ids, late, positions, slot_mapping, seq_lens, query_lens,
                      query_start_loc, logits_indices, sample_rows, graph)
    if graph is not None:
        _pad_to_graph(host, graph)
    return host


def _pad_to_graph(host: HostInputs, graph: GraphShape) -> None:
    num_tokens, num_seqs = len(host.input_ids), len(host.rows)
    pad_tokens, pad_seqs = graph.num_tokens - num_tokens, graph.num_seqs - num_seqs
    host.input_ids = _pad(host.input_ids, pad_tokens, 0)
    host.positions = _pad(host.positions, pad_tokens, 0)
    host.slot_mapping = _pad(host.slot_mapping, pad_tokens, -1)
    host.rows = _pad(host.rows, pad_seqs, 0)
    if not graph.mixed:
        host.seq_lens = _pad(host.seq_lens, pad_seqs, 1)
        return
    # Empty sequences, then the one that owns the padding tokens, without context.
    host.seq_lens = _pad(_pad(host.seq_lens, pad_seqs - 1, 0), 1, pad_tokens)
    host.query_start_loc = _pad(_pad(host.query_start_loc, pad_seqs - 1, num_tokens), 1,
                                graph.num_tokens)


def _check_lengths(batch: InputBatch, rows: np.ndarray, seq_lens: np.ndarray, known: np.ndarray,
                   max_model_len: int) -> None:
    blocks, block_size = batch.num_blocks[rows], batch.block_size
    if (seq_lens > known).any():
        raise ValueError("step plan schedules tokens past a request's known tokens: "
                         f"context lengths {seq_lens.tolist()}, known {known.tolist()}")
    if (seq_lens > blocks * block_size).any():
        raise ValueError(f"step plan gives too few blocks: context lengths {seq_lens.tolist()}, "
                         f"blocks {blocks.tolist()} of {block_size} tokens")
    if seq_lens.max() > max_model_len:
        raise ValueError(f"step plan exceeds max_model_len {max_model_len}: "
                         f"context lengths {seq_lens.tolist()}")


def _pad(array: np.ndarray, n: int, value: int) -> np.ndarray:
    return np.concatenate((array, np.full(n, value, dtype=array.dtype)))
