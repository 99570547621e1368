"""RoPE tables against transformers 5: the inverse frequencies and attention scaling of its
ROPE_INIT_FUNCTIONS bit for bit, and the cos / sin of its rotary embedding modules, for configs
in the legacy `rope_scaling` form and transformers 5's `rope_parameters` form."""
import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from pagedserve.executor_svc.layers.rotary import (Rope, cos_sin_cache, rope_from_config,
                                                 rope_inv_freq)

LLAMA = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 4096}
# Phi-3.5-mini's shape (head_dim 96) with LongRoPE factors of its length, and Phi-4-mini's
# partial rotary (0.75 of 128 dims).
LONG = [1.0 + 0.25 * i for i in range(48)]
SHORT = [1.0 + 0.01 * i for i in range(48)]
PHI3 = {"hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "long_factor": LONG, "short_factor": SHORT}}
PHI4_MINI = {"hidden_size": 3072, "num_attention_heads": 24, "max_position_embeddings": 131072,
             "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
             "rope_theta": 10000.0,
             "rope_scaling": {"rope_type": "longrope", "long_factor": LONG, "short_factor": SHORT}}

CASES = {
    "default-legacy": (LlamaConfig, {**LLAMA, "rope_theta": 500000.0}, 300),
    "default-rope-parameters": (LlamaConfig, {**LLAMA, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e6}}, 300),
    "linear-legacy-type-key": (LlamaConfig, {**LLAMA, "rope_scaling": {
        "type": "linear", "factor": 4.0}}, 300),
    # Gemma 3's global layers.
    "linear-rope-parameters": (LlamaConfig, {**LLAMA, "head_dim": 256, "rope_parameters": {
        "rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}, 300),
    "dynamic-within-max-positions": (LlamaConfig, {**LLAMA, "rope_scaling": {
        "rope_type": "dynamic", "factor": 2.0}}, 300),
    "dynamic-beyond-max-positions": (LlamaConfig, {**LLAMA, "rope_scaling": {
        "rope_type": "dynamic", "factor": 2.0}}, 6000),
    # Qwen2.5's 128K recipe.
    "yarn-qwen2.5": (LlamaConfig, {**LLAMA, "max_position_embeddings": 32768, "rope_theta": 1e6,
                                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32768}},
                     300),
    "yarn-mscale-beta-rope-parameters": (LlamaConfig, {**LLAMA, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
        "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
        "original_max_position_embeddings": 1024}}, 300),
    # gpt-oss's untruncated ramp, and an explicit attention factor.
    "yarn-untruncated-attention-factor": (LlamaConfig, {**LLAMA, "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "attention_factor": 1.25, "original_max_position_embeddings": 128}},
        300),
    "llama3": (LlamaConfig, {**LLAMA, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}}, 300),
    "longrope-short": (Phi3Config, PHI3, 4096),
    "longrope-long": (Phi3Config, PHI3, 4097),
    "longrope-partial-phi4-mini": (Phi3Config, PHI4_MINI, 5000),
    "default-partial": (Phi3Config, {**LLAMA, "partial_rotary_factor": 0.5}, 300),
}


@pytest.mark.parametrize("case", CASES)
def test_table_is_transformers(case: str) -> None:
    config_class, config, max_positions = CASES[case]
    hf = config_class(**config)
    rope = rope_from_config(config)
    inv_freq, scaling = rope_inv_freq(rope, max_positions)
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        rotary = Phi3RotaryEmbedding if config_class is Phi3Config else LlamaRotaryEmbedding
        hf_inv_freq, hf_scaling = rotary.compute_default_rope_parameters(hf)
    else:
        hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", seq_len=max_positions)
    assert torch.equal(inv_freq, hf_inv_freq) and scaling == hf_scaling

    module = (Phi3RotaryEmbedding if config_class is Phi3Config else LlamaRotaryEmbedding)(hf)
    cos, sin = module(torch.zeros(1), torch.arange(max_positions)[None])
    half = rope.rotary_dim // 2
    assert torch.equal(cos_sin_cache(rope, max_positions),
                       torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1))


def test_config_forms() -> None:
    assert rope_from_config(PHI4_MINI).rotary_dim == 96
    legacy = rope_from_config({**LLAMA, "rope_theta": 1e6,
                               "rope_scaling": {"type": "yarn", "factor": 4.0}})
    modern = rope_from_config({**LLAMA, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}})
    assert legacy == modern == Rope(64, 1e6, {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 4096},
                                    1.0, 4096)
    # transformers 5 nests Gemma 3's two ropes by layer type.
    gemma3 = {**LLAMA, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert rope_from_config(gemma3, "sliding_attention") == Rope(64, 1e4, None, 1.0, 4096)
    assert rope_from_config(gemma3, "full_attention").scaling == {"rope_type": "linear",
                                                                  "factor": 8.0}


def test_a_rope_without_max_positions_says_what_it_needs() -> None:
    with pytest.raises(ValueError, match="needs the model's max_position_embeddings"):
        cos_sin_cache(Rope(64, 5e5, {"rope_type": "dynamic", "factor": 2.0}), 50)
