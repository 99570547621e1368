"""Row-wise argmax over a vocabulary, optionally of logits perturbed by exponential noise (the
Gumbel-max trick in log space: argmax(logits - log E) draws a token from softmax(logits)).

torch's argmax reduces a long row with few thread blocks, which dominates at small batches
(~28 us for one 128k row on an H200); here the row is split over many programs and their
candidates are reduced in a second launch."""
import torch
import triton
import triton.language as tl

CHUNK = 4096


@triton.jit
def _chunk_argmax_kernel(x, noise, best_values, best_indices, vocab, stride_x, stride_noise,
                         num_chunks, HAS_NOISE: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < vocab
    values = tl.load(x + row * stride_x + offs, mask=mask, other=-float("inf")).to(tl.float32)
    if HAS_NOISE:
        e = tl.load(noise + row * stride_noise + offs, mask=mask, other=1.0).to(tl.float32)
        values = values - tl.log(e)
    # NaN never wins; a chunk of -inf (masked) tokens offers its first one.
    values = tl.where(values != values, -float("inf"), values)
    best, index = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_values + row * num_chunks + chunk, best)
    tl.store(best_indices + row * num_chunks + chunk, chunk * CHUNK + index)


@triton.jit
def _reduce_argmax_kernel(best_values, best_indices, out, num_chunks, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    mask = offs < num_chunks
    values = tl.load(best_values + row * num_chunks + offs, mask=mask, other=-float("inf"))
    indices = tl.load(best_indices + row * num_chunks + offs, mask=mask, other=0)
    # Chunks come in vocabulary order, so the leftmost maximum is the first token that has it.
    _, chunk = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out + row, tl.sum(tl.where(offs == chunk, indices, 0), axis=0))


def argmax(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """argmax(x, dim=-1) of x [N, V] (the first index on ties), or with `noise` [N, V] > 0
    argmax(x - log(noise)); returns int64 [N]. Rows must be contiguous in their last dim."""
    num_rows, vocab = x.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    best_values = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=x.device)
    best_indices = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=x.device)
    _chunk_argmax_kernel[(num_rows, num_chunks)](
        x, x if noise is None else noise, best_values, best_indices, vocab, x.stride(0),
        0 if noise is None else noise.stride(0), num_chunks, HAS_NOISE=noise is not None,
        CHUNK=CHUNK)
    _reduce_argmax_kernel[(num_rows,)](best_values, best_indices, out, num_chunks,
                                       CHUNKS_PAD=triton.next_power_of_2(num_chunks))
    return out
