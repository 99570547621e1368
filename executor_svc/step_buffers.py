"""Where a step's inputs live: a pinned host staging area, and device buffers at fixed addresses
that every step copies into (so a CUDA graph captured on them reads each step's values)."""
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 64


@dataclass(slots=True)
class StepBuffers:
    """Device inputs of one step, each used through its first rows."""
    input_ids: torch.Tensor        # [max_tokens] int64
    positions: torch.Tensor        # [max_tokens] int64
    slot_mapping: torch.Tensor     # [max_tokens] int64
    rows: torch.Tensor             # [max_seqs] int64: the persistent-batch row of each sequence
    seq_lens: torch.Tensor         # [max_seqs] int32
    query_start_loc: torch.Tensor  # [max_seqs + 1] int32
    block_tables: torch.Tensor     # [max_seqs, max_blocks] int32
    # 0, 1, 2, ...: the query_start_loc of every padded decode step, so those steps copy none.
    decode_query_start_loc: torch.Tensor  # [max_seqs + 1] int32

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks: int,
                 device: torch.device) -> "StepBuffers":
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(zeros(max_tokens), zeros(max_tokens), zeros(max_tokens), zeros(max_seqs),
                   zeros(max_seqs, dtype=torch.int32), zeros(max_seqs + 1, dtype=torch.int32),
                   zeros(max_seqs, max_blocks, dtype=torch.int32),
                   torch.arange(max_seqs + 1, dtype=torch.int32, device=device))


class Staging:
    """Host-to-device copies through one pinned buffer that each step refills from the start.

    `reset` waits for the previous step's copies (an event), so refilling never overwrites bytes
    that a copy still reads, even when a step ends without a host sync."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.copied = torch.cuda.Event() if cuda else None
        self.offset = 0

    def reset(self) -> None:
        """Starts a step's uploads once the previous step's have left the buffer."""
        if self.copied is not None:
            self.copied.synchronize()
        self.offset = 0

    def uploaded(self) -> None:
        """Marks the end of a step's uploads."""
        if self.copied is not None:
            self.copied.record()

    def upload(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copies `array` to the device, into `out` if given; returns the device tensor."""
        start = self.offset
        end = start + array.nbytes
        if end > self.buffer.numel():
            raise ValueError(f"a step needs more than the {self.buffer.numel()} bytes of host "
                             "staging sized from max_num_batched_tokens and max_num_seqs")
        self.offset = -(-end // ALIGN) * ALIGN
        staged = self.buffer.numpy()[start:end].view(array.dtype).reshape(array.shape)
        staged[...] = array
        host = torch.from_numpy(staged)
        if out is None:
            return host.to(self.device, non_blocking=True)
        return out.copy_(host, non_blocking=True)


def upload_pinned(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Copies an array of any size to the device without a host sync, through pinned memory from
    torch's caching host allocator, which keeps it until the copy is done (for inputs that the
    staging buffer is not sized for, such as the token ids of penalised rows)."""
    source = torch.from_numpy(array)
    if device.type != "cuda":
        return source
    host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    host.copy_(source)
    return host.to(device, non_blocking=True)
