"""Bidirectional attention over packed sequences (an encoder's): each token attends to every
token of its own sequence and to none of the others', with no KV cache.

On a GPU in bf16/fp16 it is torch's varlen FlashAttention (torch.nn.attention.varlen): one
kernel over the packed tokens, no padding, so a batch of 32- to 512-token inputs costs what its
tokens cost. Elsewhere (the CPU, fp32, a torch without varlen) the sequences are padded to the
longest and run through SDPA with a key mask: exact, and the padding only costs attention
FLOPs, which at 512 tokens and hidden 1024 are ~8% of a layer's (4·L·d against the GEMMs'
24·d² per token)."""
from dataclasses import dataclass
from functools import cache

import torch
from torch.nn import functional as F

FLASH_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(slots=True)
class PackedSequences:
    """Where each sequence of a packed batch lies: cu_seqlens [B + 1] (int32, the varlen
    kernel's), max_len; for the padded path, each token's row in the [B * max_len] padded layout
    and the keys each padded row may see ([B, 1, 1, max_len])."""
    cu_seqlens: torch.Tensor
    max_len: int
    padded_rows: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None


def pack_sequences(seq_lens: list[int], device: torch.device, dtype: torch.dtype) -> PackedSequences:
    """The layout of sequences of `seq_lens` tokens packed one after another, for attend()."""
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu_seqlens = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    max_len = max(seq_lens)
    if use_varlen(device, dtype):
        return PackedSequences(cu_seqlens, max_len)
    offsets = torch.arange(int(cu_seqlens[-1]), device=device) - cu_seqlens[:-1].repeat_interleave(lens)
    starts = torch.arange(len(seq_lens), device=device).repeat_interleave(lens) * max_len
    key_mask = torch.arange(max_len, device=device) < lens[:, None]
    return PackedSequences(cu_seqlens, max_len, starts + offsets, key_mask[:, None, None, :])


def use_varlen(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in FLASH_DTYPES and _varlen_attn() is not None


def load_kernels(device: torch.device, dtype: torch.dtype) -> None:
    """Imports the attention an encoder on `device` in `dtype` runs, at start rather than in its
    first request: on a GPU the varlen import (and torch._dynamo with it) takes seconds."""
    use_varlen(device, dtype)


@cache
def _varlen_attn():
    # Imported on first use: torch.nn.attention.varlen imports torch._dynamo, which took 2 s of
    # every process's start (the launcher's and the executor's) on the 2-core CPU.
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    return varlen_attn


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
    """q, k, v [T, heads, head_dim] of packed sequences -> [T, heads, head_dim], softmax scale
    head_dim ** -0.5."""
    if packed.padded_rows is None:
        # Positional arguments only: the keyword ones changed between torch 2.9 and 2.13. q, k
        # and v are views of the fused projection; contiguous copies cost <1% of the layer and
        # spare relying on each backend's (flash, cuDNN) stride support.
        q, k, v = (x.contiguous() for x in (q, k, v))
        return _varlen_attn()(q, k, v, packed.cu_seqlens, packed.cu_seqlens, packed.max_len, packed.max_len)
    batch = packed.key_mask.shape[0]
    q, k, v = (_padded(x, packed, batch) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=packed.key_mask)
    return out.transpose(1, 2).flatten(0, 1)[packed.padded_rows]


def _padded(x: torch.Tensor, packed: PackedSequences, batch: int) -> torch.Tensor:
    """[T, heads, head_dim] -> [B, heads, max_len, head_dim], zeros past each sequence's end."""
    padded = x.new_zeros(batch * packed.max_len, *x.shape[1:]).index_copy_(0, packed.padded_rows, x)
    return padded.view(batch, packed.max_len, *x.shape[1:]).transpose(1, 2)
