"""Logits processing around sampling: raw logprobs first, then stop tokens masked until
min_tokens, the structured-output grammar's token bitmask, allowed_token_ids' (the same form),
logit_bias, and repetition, frequency
and presence penalties (vLLM's order; a masked token stays at -inf whatever its bias). Batched
tensor functions with no host sync; rows that use none of this cost nothing. Also the prompt
logprobs, computed a chunk of positions at a time."""
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.common.plan import StepLogprobs
from pagedserve.common.sampling_params import MAX_LOGIT_BIAS_TOKENS
from pagedserve.executor_svc.step_buffers import upload_pinned


def mask_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Sets logits[rows[i], token_ids[i]] to -inf in place (contiguous logits): the stop tokens of
    rows that have fewer than min_tokens outputs."""
    # index_fill_ takes the value as a scalar; index_put_ would copy it to the device and sync.
    logits.view(-1).index_fill_(0, rows * logits.shape[1] + token_ids, float("-inf"))


@dataclass(slots=True)
class GrammarMask:
    """The constrained rows of a batch (indices into its logits) and their packed token bitmask."""
    rows: torch.Tensor     # [k] int64
    bitmask: torch.Tensor  # [k, ceil(vocab / 32)] int32, bit j of word w allows token 32 w + j

    def apply(self, logits: torch.Tensor) -> None:
        """Sets the logits of the tokens each constrained row's grammar refuses to -inf, in place.

        The mask is added as floats, -inf where refused and 0 where allowed, built from the bits
        by integer ops: a boolean mask's masked_fill took 1.5 ms for 16 rows of 49,152 on the
        2-core machine, and the whole apply 3.2 ms against this one's 1.5."""
        vocab = logits.shape[1]
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = (self.bitmask[:, :, None] >> shifts) & 1
        # 1 - 1 is 0.0's bits; 0 - 1 is all ones, which NEG_INF_BITS keeps as -inf's.
        added = ((allowed - 1) & NEG_INF_BITS).view(torch.float32).view(len(self.rows), -1)[:, :vocab]
        logits.index_add_(0, self.rows, added)


# float32 -inf's bits (0xff800000) as an int32.
NEG_INF_BITS = -(1 << 23)


@dataclass(slots=True)
class LogitBias:
    """The rows of a batch that set a logit_bias (indices into its logits) and their entries,
    [k, width] each; an entry past a row's own count adds 0."""
    rows: torch.Tensor       # [k] int64
    token_ids: torch.Tensor  # [k, width] int32, each in [0, vocab)
    values: torch.Tensor     # [k, width] float32

    def apply(self, logits: torch.Tensor) -> None:
        """Adds each row's bias to its logits in place (contiguous logits)."""
        flat = self.rows[:, None] * logits.shape[1] + self.token_ids
        logits.view(-1).index_add_(0, flat.view(-1), self.values.reshape(-1))


class LogitBiasTable:
    """Every row's logit_bias on the device, uploaded once when its request arrives: a step only
    gathers the rows it samples. At most MAX_LOGIT_BIAS_TOKENS entries a row (the scheduler refuses
    more), so the table is small: 8 KiB a row."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.token_ids = torch.zeros(max_rows, MAX_LOGIT_BIAS_TOKENS, dtype=torch.int32, device=device)
        self.values = torch.zeros(max_rows, MAX_LOGIT_BIAS_TOKENS, dtype=torch.float32, device=device)
        self.lengths = np.zeros(max_rows, dtype=np.int64)
        self.rows: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.rows)

    def set(self, row: int, bias: dict[int, float]) -> None:
        ids = np.fromiter(bias, dtype=np.int64, count=len(bias))
        values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        # Behind the scheduler's check, as a second guard: an id past the vocabulary would land in
        # the next row of the flat logits, another request's.
        keep = (ids >= 0) & (ids < self.vocab_size)
        ids, values = ids[keep][:MAX_LOGIT_BIAS_TOKENS], values[keep][:MAX_LOGIT_BIAS_TOKENS]
        n = len(ids)
        self.lengths[row] = n
        if not n:
            return
        # The entries past n are a former request's: a step gathers them with a longer row's.
        self.values[row].zero_()
        self.token_ids[row, :n] = upload_pinned(ids.astype(np.int32), self.device)
        self.values[row, :n] = upload_pinned(values, self.device)
        self.rows.add(row)

    def clear(self, row: int) -> None:
        self.lengths[row] = 0
        self.rows.discard(row)

    def select(self, rows: np.ndarray, upload: Callable[[np.ndarray], torch.Tensor]) -> LogitBias | None:
        """The bias of the batch `rows` that have one; None if none has."""
        index = np.flatnonzero(self.lengths[rows])
        if not len(index):
            return None
        biased = rows[index]
        width = int(self.lengths[biased].max())
        table = upload(np.stack((index, biased)))
        return LogitBias(table[0], self.token_ids[table[1], :width], self.values[table[1], :width])


class AllowedTokensTable:
    """Every row's allowed_token_ids as a packed bitmask on the device (GrammarMask's form), set once
    when its request arrives: a step gathers the rows it samples. ceil(vocab / 32) words a row:
    19 KiB at a 152k vocabulary, allocated for every row at the first request that sets one."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, device
        self.bitmask: torch.Tensor | None = None
        self.active = np.zeros(max_rows, dtype=bool)
        self.rows: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.rows)

    def set(self, row: int, token_ids: list[int]) -> None:
        ids = np.asarray(token_ids, dtype=np.int64)
        # Behind the scheduler's check: an id past the vocabulary would set another word's bit.
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        words = np.zeros(-(-self.vocab_size // 32), dtype=np.int64)
        np.bitwise_or.at(words, ids >> 5, np.left_shift(1, ids & 31))
        if self.bitmask is None:
            self.bitmask = torch.zeros(self.max_rows, len(words), dtype=torch.int32, device=self.device)
        self.bitmask[row] = upload_pinned(words.astype(np.uint32).view(np.int32), self.device)
        self.active[row] = True
        self.rows.add(row)

    def clear(self, row: int) -> None:
        self.active[row] = False
        self.rows.discard(row)

    def select(self, rows: np.ndarray, upload: Callable[[np.ndarray], torch.Tensor]) -> GrammarMask | None:
        """The masks of the batch `rows` that have one; None if none has."""
        index = np.flatnonzero(self.active[rows])
        if not len(index):
            return None
        table = upload(np.stack((index, rows[index])))
        return GrammarMask(table[0], self.bitmask[table[1]])


@dataclass(slots=True)
class Penalties:
    """The rows of a batch that use a penalty (indices into its logits), with apply_penalties'
    other arguments for them."""
    rows: torch.Tensor
    token_ids: torch.Tensor
    num_prompt: torch.Tensor
    repetition: torch.Tensor | None
    frequency: torch.Tensor | None
    presence: torch.Tensor | None

    def apply(self, logits: torch.Tensor) -> None:
        """In place on logits [N, vocab]; the other rows stay as they are."""
        apply_penalties(logits, self.rows, self.token_ids, self.num_prompt, self.repetition,
                        self.frequency, self.presence)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                    num_prompt: torch.Tensor, repetition: torch.Tensor | None,
                    frequency: torch.Tensor | None, presence: torch.Tensor | None) -> None:
    """vLLM's penalties, in place on the `rows` [R] of contiguous float32 logits [N, vocab].
    token_ids [R, L] holds each row's prompt (its first num_prompt[i] entries, at least one) then
    its outputs, padded with vocab. repetition divides the positive logits and multiplies the
    negative ones of every token seen in prompt or output; frequency subtracts per occurrence in
    the output, presence once per token there. A penalty no row uses is None.

    Only the listed tokens' logits are read and written, each occurrence of a token writing the
    same value: passes over whole rows took 5.9 ms for a repetition penalty and 10.8 ms for all
    three at 16 rows of 49,152 and 192 tokens on the 2-core machine."""
    vocab = logits.shape[1]
    listed = token_ids < vocab
    # Padding stands for the row's first token, a prompt's, and so writes what that one writes.
    index = rows[:, None] * vocab + torch.where(listed, token_ids, token_ids[:, :1])
    flat = logits.view(-1)
    values = flat[index]
    if repetition is not None:
        values = torch.where(values > 0, values / repetition[:, None], values * repetition[:, None])
    if frequency is not None or presence is not None:
        positions = torch.arange(token_ids.shape[1], device=token_ids.device)
        counts = _output_counts(index, listed & (positions[None, :] >= num_prompt[:, None]))
        if frequency is not None:
            values = values - frequency[:, None] * counts
        if presence is not None:
            values = values - presence[:, None] * (counts > 0)
    flat[index] = values


def _output_counts(index: torch.Tensor, is_output: torch.Tensor) -> torch.Tensor:
    """How often each entry's (row, token) `index` occurs where is_output, as float32 of index's
    shape; by a sort and two binary searches, with no size that depends on the data (no host
    sync on a GPU)."""
    outputs = torch.where(is_output, index, -1).flatten().sort().values
    found = torch.searchsorted(outputs, index, right=True) - torch.searchsorted(outputs, index)
    return found.float()


@dataclass(slots=True)
class LogprobRows:
    """The rows of a batch that asked for logprobs (indices into it, on the host and the device),
    and how many top logprobs each asked for."""
    index: np.ndarray
    device_index: torch.Tensor
    num_top: np.ndarray

    @property
    def max_top(self) -> int:
        return int(self.num_top.max())


@dataclass(slots=True)
class SampledLogprobs:
    """Per row that asked, packed for one device-to-host copy each: column 0 holds the sampled
    token's logprob and rank (1 = most likely), columns 1..k the top k tokens' logprobs and ids."""
    values: torch.Tensor  # [M, 1 + k] float32
    ids: torch.Tensor     # [M, 1 + k] int64


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> SampledLogprobs:
    """From log_softmax'd raw logits [M, vocab] and the tokens sampled in those rows [M]."""
    chosen = logprobs.gather(-1, sampled[:, None])
    # vLLM's rank: how many tokens are at least as likely as the sampled one.
    rank = (logprobs >= chosen).sum(-1, keepdim=True)
    top = logprobs.topk(k, dim=-1)
    return SampledLogprobs(torch.cat((chosen, top.values), 1), torch.cat((rank, top.indices), 1))


# Prompt positions whose logits exist at once (SEC-12). A step's prompt positions can number
# max_num_batched_tokens, and their float32 logits plus log_softmax take 8 bytes per position and
# vocabulary entry: 10 GB at 8192 positions of a 152k vocabulary, beyond what the memory profile
# reserves, so one long prompt would fail the step of every request in it. A chunk of 512 takes
# 0.6 GB there, and the profile runs one (ModelRunner.dummy_run). A chunk costs a few kernel
# launches, small beside the forward over the same 512 positions.
PROMPT_LOGPROBS_CHUNK = 512


def chunked_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                     index: torch.Tensor, targets: torch.Tensor, k: int,
                     chunk: int = PROMPT_LOGPROBS_CHUNK) -> SampledLogprobs:
    """gather_logprobs of the logits of hidden[index] [N] against targets [N], with at most
    `chunk` rows of logits at a time."""
    parts = [gather_logprobs(compute_logits(hidden[i]).float().log_softmax(dim=-1), t, k)
             for i, t in zip(index.split(chunk), targets.split(chunk))]
    if len(parts) == 1:
        return parts[0]
    return SampledLogprobs(torch.cat([p.values for p in parts]), torch.cat([p.ids for p in parts]))


def step_logprobs(rows: np.ndarray, num_top: np.ndarray, values: np.ndarray,
                  ids: np.ndarray) -> StepLogprobs:
    """The wire form of a step's SampledLogprobs on the host: rows index the step's sampled
    tokens, and row i keeps its own num_top[i] of the batch's k top tokens."""
    keep = np.arange(values.shape[1] - 1)[None, :] < num_top[:, None]
    return StepLogprobs(rows.tolist(), values[:, 0].tolist(), ids[:, 0].tolist(), num_top.tolist(),
                        ids[:, 1:][keep].tolist(), values[:, 1:][keep].tolist())
