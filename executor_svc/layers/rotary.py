"""Rotary position embedding tables: default RoPE and Llama 3.1's frequency scaling."""
import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "llama3")


class RotaryEmbedding(nn.Module):
    """The table of cos/sin by position that the decoder stack hands its attention layers."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(head_dim, max_positions, theta, scaling),
                             persistent=False)


def build_cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                        scaling: dict | None) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of each position's angles, then sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported; pagedserve implements "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    if "freq_factors" in scaling:
        # A GGUF file carries the scaling as llama.cpp applies it: one divisor per frequency.
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    # Same arithmetic as transformers' _compute_llama3_parameters, so the tables match bit for bit.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
