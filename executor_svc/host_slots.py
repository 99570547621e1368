"""The pinned host memory of one launched step: its staging area for uploads and the buffers its
sampled tokens and logprobs land in. Steps alternate between MAX_STEPS_IN_FLIGHT slots, so a
launch never overwrites what a step still in flight reads or writes."""
from dataclasses import dataclass

import torch

from pagedserve.executor_svc.step_buffers import ALIGN, Staging

# Room for each upload's start being rounded up to ALIGN: a step makes about 15, this covers 64.
ALIGNMENT_SLACK = 64 * ALIGN


@dataclass(slots=True)
class HostSlot:
    staging: Staging
    sampled: torch.Tensor
    # Where logprobs land, as gather_logprobs packs them ([rows, 1 + k], flat).
    logprob_values: torch.Tensor
    logprob_ids: torch.Tensor

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks: int, max_logprobs: int,
                 device: torch.device) -> "HostSlot":
        pinned = device.type == "cuda"
        num_logprobs = max_seqs * (1 + max_logprobs)
        return cls(Staging(staging_bytes(max_tokens, max_seqs, max_blocks), device),
                   torch.empty(max_seqs, dtype=torch.int64, pin_memory=pinned),
                   torch.empty(num_logprobs, dtype=torch.float32, pin_memory=pinned),
                   torch.empty(num_logprobs, dtype=torch.int64, pin_memory=pinned))


def staging_bytes(max_tokens: int, max_seqs: int, max_blocks: int) -> int:
    """The most one step uploads through its staging area, every value counted as 8 bytes (some
    are int32 or float32). Per token: input ids, positions and slot mapping, and one spare. Per
    block-table entry (one step may set every entry): its row, column and block id. Per sequence,
    23: batch rows, sequence lengths, query start locations, logits indices and sample rows (5);
    the late-token index, a pair per row whose next input is a token a step in flight samples
    (2); the sampling table's 5 columns; the logprob rows (1); the grammar rows (1); the
    penalties' row index, 3 columns and prompt lengths (5); and the logit_bias and allowed_token_ids
    rows' index and batch row (2 each)."""
    words = 4 * max_tokens + 3 * max_seqs * max_blocks + 23 * max_seqs
    return 8 * words + ALIGNMENT_SLACK
