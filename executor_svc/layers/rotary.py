"""Rotary position embedding tables for the rope types of transformers' ROPE_INIT_FUNCTIONS
(default, linear, dynamic, yarn, longrope, llama3), with partial rotary.

Each table's inverse frequencies and attention scaling are computed with transformers' own
arithmetic, so they equal its results bit for bit. Where transformers recomputes frequencies
for each sequence length (dynamic, longrope), pagedserve builds one static table for the longest
sequence it serves, as vLLM does: the KV cache keeps keys rotated by earlier steps, which a table
that changed with the length would no longer match.
"""
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(slots=True)
class Rope:
    """A model's (or one layer type's) rotary embedding, as its config.json describes it."""
    head_dim: int
    theta: float = 10000.0
    # rope_type and that type's parameters under transformers' names; None: default RoPE.
    scaling: dict | None = None
    # Partial rotary (Phi-4-mini: 0.75): only the first int(head_dim * factor) dims rotate.
    partial_rotary_factor: float = 1.0
    # config.json's max_position_embeddings: dynamic scaling reads it, and yarn and longrope
    # without an explicit `factor`.
    max_position_embeddings: int | None = None

    @property
    def dim(self) -> int:
        """The rotated dims of each head, as transformers counts them (`rotary_dim` rounds up)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rotary_dim(self) -> int:
        """The width of the cos/sin table: the leading dims of each head that rotate."""
        return 2 * ((self.dim + 1) // 2)


def rope_from_config(config: dict, layer_type: str | None = None) -> Rope:
    """The rotary embedding of a Hugging Face config.json, read as transformers 5 reads it.

    Takes transformers 5's `rope_parameters` (theta inside; nested per layer type for models
    such as Gemma 3, whose `layer_type` picks one) or the legacy `rope_theta` + `rope_scaling`
    (which wins when both are present, as in transformers), the legacy `type` key, a top-level
    `partial_rotary_factor`, and Phi-3's top-level `original_max_position_embeddings`, which
    wins over the one in the scaling parameters. A flat config gives every layer type the same
    rope: keys of one model's own (Gemma 3's legacy `rope_local_base_freq` for its sliding
    layers) are that model's to read.
    """
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if layer_type is not None and layer_type in params:
        params = dict(params[layer_type])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    partial = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    # Early Phi-3 long-context configs call LongRoPE "su".
    rope_type = "longrope" if rope_type == "su" else rope_type
    max_positions = config.get("max_position_embeddings")
    if rope_type in ("llama3", "yarn", "longrope"):
        params["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings",
            params.get("original_max_position_embeddings", max_positions))
    scaling = None if rope_type == "default" else {"rope_type": rope_type, **params}
    return Rope(head_dim, theta, scaling, float(partial), max_positions)


def cos_sin_cache(rope: Rope, max_positions: int) -> torch.Tensor:
    """[max_positions, rope.rotary_dim] float32: cos of each position's angles, then sin, both
    times the rope's attention scaling (yarn's and longrope's mscale), as `rotary_write_kv`
    reads them. max_positions: the longest sequence served (the max model length), which the
    dynamic and longrope tables depend on."""
    inv_freq, attention_scaling = rope_inv_freq(rope, max_positions)
    # One product per element, as transformers' rotary embedding forms the angles.
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos() * attention_scaling, angles.sin() * attention_scaling), dim=-1)


class RotaryEmbedding(nn.Module):
    """The table of cos/sin by position that the decoder stack hands its attention layers."""

    def __init__(self, rope: Rope, max_positions: int) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", cos_sin_cache(rope, max_positions), persistent=False)


def rope_inv_freq(rope: Rope, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] float32, attention scaling of cos and sin), as
    transformers' ROPE_INIT_FUNCTIONS return them for a sequence of max_positions tokens."""
    rope_type = rope.scaling["rope_type"] if rope.scaling else "default"
    if rope_type not in _INV_FREQ:
        raise ValueError(f"rope type {rope_type!r} is not supported; pagedserve implements "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    return _INV_FREQ[rope_type](rope, rope.scaling or {}, max_positions)


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _default(rope: Rope, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(rope.theta, rope.dim), 1.0


def _linear(rope: Rope, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(rope.theta, rope.dim) / scaling["factor"], 1.0


def _dynamic(rope: Rope, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    # Dynamic NTK: transformers recomputes the base for each forward's longest sequence (the
    # unscaled base up to max_position_embeddings); vLLM builds one table for the length
    # max_position_embeddings * factor. This table is transformers' for max_positions tokens:
    # the two agree for every sequence when max_positions <= max_position_embeddings (no
    # scaling), and for a sequence of exactly max_positions tokens otherwise; vLLM's table is
    # this one at max_positions = max_position_embeddings * factor, its default max_model_len.
    original = _needs_max_positions(rope)
    factor = scaling["factor"]
    seq_len = max(max_positions, original)
    dim = rope.dim
    base = rope.theta * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim), 1.0


def _yarn(rope: Rope, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    # transformers' _compute_yarn_parameters, step for step.
    dim, base = rope.dim, rope.theta
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = _needs_max_positions(rope) / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale)
                                     / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    low = _yarn_correction_dim(beta_fast, dim, base, original)
    high = _yarn_correction_dim(beta_slow, dim, base, original)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
                + (1.0 / pos_freqs) * extrapolation)
    return inv_freq, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, original: int) -> float:
    return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _longrope(rope: Rope, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    # transformers switches between the short and long factors on each forward's longest
    # sequence (its KV cache then mixes keys rotated by both); vLLM, and pagedserve, choose once,
    # the long factors when the served length (max_positions, the max model length) passes
    # original_max_position_embeddings, so that every cached key shares one table. Both agree
    # for every sequence when max_positions <= original_max_position_embeddings, and for the
    # sequences longer than that otherwise.
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = _needs_max_positions(rope) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    long = max_positions > original
    ext_factors = torch.tensor(scaling["long_factor" if long else "short_factor"],
                               dtype=torch.float32)
    dim = rope.dim
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * rope.theta ** shape), attention_factor


def _llama3(rope: Rope, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(rope.theta, rope.dim)
    if "freq_factors" in scaling:
        # A GGUF file carries the scaling as llama.cpp applies it: one divisor per frequency.
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32), 1.0
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
    return torch.where(is_medium, smoothed, scaled), 1.0


def _needs_max_positions(rope: Rope) -> int:
    if rope.max_position_embeddings is None:
        raise ValueError(f"rope type {rope.scaling['rope_type']!r} here needs the model's "
                         "max_position_embeddings: build the Rope with rope_from_config")
    return rope.max_position_embeddings


_INV_FREQ: dict[str, Callable[[Rope, dict, int], tuple[torch.Tensor, float]]] = {
    "default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn,
    "longrope": _longrope, "llama3": _llama3,
}
