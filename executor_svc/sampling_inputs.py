"""A step's sampling inputs, read off the persistent batch for the rows that sample: the
SamplingBatch's device columns, the token mask (stop ids, bad words), the grammar and allowed-token
bitmasks, logit_bias, penalties, the logprob rows, and the prompt logprobs that the step's prompt
positions give."""
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.executor_svc.input_batch import InputBatch
from pagedserve.executor_svc.logits import (GrammarMask, LogprobRows, Penalties, SampledLogprobs,
                                            chunked_logprobs, step_logprobs)
from pagedserve.executor_svc.sampler import SamplingBatch, make_sampling_batch
from pagedserve.executor_svc.step_buffers import Staging, upload_pinned
from pagedserve.executor_svc.structured_outputs import StructuredOutputs
from pagedserve.common.plan import PromptLogprobs


@dataclass(slots=True)
class PendingPrompt:
    """The prompt logprobs a launched step computes (see PromptLogprobs), on the host once the
    device passes the step's end."""
    seq_ids: list[int]
    starts: list[int]
    counts: list[int]
    num_top: np.ndarray
    logprobs: SampledLogprobs

    def result(self) -> PromptLogprobs:
        lp = self.logprobs
        entries = step_logprobs(np.arange(len(self.num_top)), self.num_top, lp.values.numpy(), lp.ids.numpy())
        return PromptLogprobs(self.seq_ids, self.starts, self.counts, entries)


class SamplingInputs:
    """Builds each step's sampling inputs from `batch` and `structured`, uploading them through
    the step's staging area, or through pinned memory of their own when unbounded in size."""

    def __init__(self, batch: InputBatch, structured: StructuredOutputs, vocab_size: int) -> None:
        self.batch = batch
        self.structured = structured
        self.vocab_size = vocab_size

    def sampling(self, rows: np.ndarray, staging: Staging) -> SamplingBatch:
        b = self.batch
        generators = {}
        if b.generators:
            generators = {i: b.generators[row] for i, row in enumerate(rows.tolist())
                          if row in b.generators}
        sampling = make_sampling_batch(b.temperature[rows], b.top_p[rows], b.top_k[rows],
                                       b.min_p[rows], generators, staging.upload)
        if b.stop_ids or b.bad_words:
            mask = b.token_mask(rows)
            # Unbounded (a request may name many stop ids), so not through the staging buffer.
            sampling.token_mask = None if mask is None else upload_pinned(mask, staging.device)
        if self.structured:
            sampling.grammar = self._grammar(rows, staging)
        if b.logit_bias:
            sampling.logit_bias = b.logit_bias.select(rows, staging.upload)
        if b.allowed:
            sampling.allowed = b.allowed.select(rows, staging.upload)
        if b.penalised:
            sampling.penalties = self._penalties(rows, staging)
        if b.logprob_rows:
            num_top = b.num_logprobs[rows]
            index = np.flatnonzero(num_top >= 0)
            if len(index):
                sampling.logprobs = LogprobRows(index, staging.upload(index), num_top[index])
        return sampling

    def prompt_logprobs(self, rows: np.ndarray, query_lens: np.ndarray, seq_ids: np.ndarray,
                        hidden: torch.Tensor,
                        compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> PendingPrompt | None:
        """Queues the logprobs of the prompt tokens that this step's positions predict, for the
        requests that asked: the logits of every such position, not only the last, a chunk of
        positions at a time (logits.PROMPT_LOGPROBS_CHUNK)."""
        found = self.batch.prompt_positions(rows, query_lens)
        if found is None:
            return None
        index, starts, counts, token_index, targets = found
        num_top = np.repeat(self.batch.num_prompt_logprobs[rows[index]], counts)
        device = hidden.device
        lp = chunked_logprobs(compute_logits, hidden, upload_pinned(token_index, device),
                              upload_pinned(targets, device), int(num_top.max()))
        if device.type == "cuda":
            lp = SampledLogprobs(_to_host(lp.values), _to_host(lp.ids))
        return PendingPrompt(seq_ids[index].tolist(), (starts + 1).tolist(), counts.tolist(), num_top, lp)

    def _grammar(self, rows: np.ndarray, staging: Staging) -> GrammarMask | None:
        filled = self.structured.fill(self.batch.seq_ids[rows])
        if filled is None:
            return None
        index, bitmask = filled
        # Through pinned memory of its own: the next step refills the bitmask buffer.
        return GrammarMask(staging.upload(index), upload_pinned(bitmask, staging.device))

    def _penalties(self, rows: np.ndarray, staging: Staging) -> Penalties | None:
        b, upload = self.batch, staging.upload
        repetition, frequency, presence = b.repetition[rows], b.frequency[rows], b.presence[rows]
        index = np.flatnonzero((repetition != 1) | (frequency != 0) | (presence != 0))
        if not len(index):
            return None
        penalised = rows[index]
        repetition, frequency, presence = repetition[index], frequency[index], presence[index]
        columns = upload(np.stack((repetition, frequency, presence)))
        token_ids = upload_pinned(b.padded_tokens(penalised, self.vocab_size), staging.device)
        return Penalties(upload(index), token_ids.long(), upload(b.num_prompt[penalised]),
                         columns[0] if (repetition != 1).any() else None,
                         columns[1] if frequency.any() else None,
                         columns[2] if presence.any() else None)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Starts copying `tensor` into pinned memory of its own (sizes vary with the prompts)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
