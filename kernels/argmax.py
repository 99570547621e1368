"""Row-wise argmax over a vocabulary, optionally of logits perturbed by exponential noise drawn in
the kernel (the Gumbel-max trick in log space: argmax(logits - log E) draws a token from
softmax(logits)).

torch's argmax reduces a long row with few thread blocks, which dominates at small batches
(~28 us for one 128k row on an H200); here the row is split over many programs and their
candidates are reduced in a second launch."""
import torch
import triton
import triton.language as tl

CHUNK = 4096


@triton.jit
def _chunk_argmax_kernel(x, seeds, noise_scale, best_values, best_indices, vocab, stride_x, num_chunks,
                         SAMPLE: tl.constexpr, SCALED: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    QUARTER: tl.constexpr = CHUNK // 4
    quarter = tl.arange(0, QUARTER)
    x += row * stride_x
    start = chunk * CHUNK
    scale = 1.0
    if SAMPLE:
        # One Philox call makes four draws, one for each quarter of the chunk: a call an element
        # did four times the multiplies.
        r0, r1, r2, r3 = tl.randint4x(tl.load(seeds + row), chunk * QUARTER + quarter)
        if SCALED:
            scale = tl.load(noise_scale + row)
    else:
        # Unread: a greedy argmax draws nothing.
        r0 = quarter.to(tl.uint32)
        r1 = r0
        r2 = r0
        r3 = r0
    best, index = _quarter_max(x, start, quarter, vocab, r0, scale, SAMPLE)
    best, index = _later_max(best, index, x, start + QUARTER, quarter, vocab, r1, scale, SAMPLE)
    best, index = _later_max(best, index, x, start + 2 * QUARTER, quarter, vocab, r2, scale, SAMPLE)
    best, index = _later_max(best, index, x, start + 3 * QUARTER, quarter, vocab, r3, scale, SAMPLE)
    tl.store(best_values + row * num_chunks + chunk, best)
    tl.store(best_indices + row * num_chunks + chunk, index)


@triton.jit
def _later_max(best, index, x, start, quarter, vocab, draws, scale, SAMPLE: tl.constexpr):
    # Quarters come in vocabulary order: a later one wins only with a strictly larger value.
    value, at = _quarter_max(x, start, quarter, vocab, draws, scale, SAMPLE)
    return tl.maximum(value, best), tl.where(value > best, at, index)


@triton.jit
def _quarter_max(x, start, quarter, vocab, draws, scale, SAMPLE: tl.constexpr):
    """The largest value of x[start:start + QUARTER] (perturbed by Gumbel noise from `draws`,
    times `scale`, when SAMPLE) and its first index."""
    offs = start + quarter
    values = tl.load(x + offs, mask=offs < vocab, other=-float("inf")).to(tl.float32)
    if SAMPLE:
        # E = -log(U) ~ Exponential(1), U uniform on 23 bits, strictly inside (0, 1): U = 0 or 1
        # would give a value of -inf or +inf (a token drawn whatever its probability).
        u = ((draws.to(tl.uint32, bitcast=True) >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        values = values - scale * tl.log(-tl.log(u))
    # NaN never wins; a quarter of -inf (masked) tokens offers its first one.
    values = tl.where(values != values, -float("inf"), values)
    best, index = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    return best, start + index


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


def argmax(x: torch.Tensor, seeds: torch.Tensor | None = None,
           noise_scale: torch.Tensor | None = None) -> torch.Tensor:
    """argmax(x, dim=-1) of x [N, V] (the first index on ties), or with `seeds` [N] (int64) a token
    a row drawn from softmax(x): argmax(x - log E), E ~ Exponential(1) drawn in the kernel from
    the row's seed (Philox), which fixes the draw. `noise_scale` [N] (float32), with seeds, draws
    at a temperature T a row instead: argmax(x - T log E) = argmax(x / T - log E) for T > 0, and
    T = 0 gives the row's argmax. Returns int64 [N]. Rows must be contiguous in their last dim."""
    num_rows, vocab = x.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    best_values = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=x.device)
    best_indices = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=x.device)
    _chunk_argmax_kernel[(num_rows, num_chunks)](
        x, x if seeds is None else seeds, x if noise_scale is None else noise_scale, best_values, best_indices,
        vocab, x.stride(0), num_chunks, SAMPLE=seeds is not None, SCALED=noise_scale is not None, CHUNK=CHUNK)
    _reduce_argmax_kernel[(num_rows,)](best_values, best_indices, out, num_chunks,
                                       CHUNKS_PAD=triton.next_power_of_2(num_chunks))
    return out
