import json

import pytest
import torch

from pagedserve.executor_svc.model_config import load_model_config, model_config_from_dict, resolve_max_model_len
from pagedserve.executor_svc.layers.rotary import Rope, cos_sin_cache
from pagedserve.common.model_shapes import SHAPES

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=4096,
             intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             max_position_embeddings=4096, rms_norm_eps=1e-5, eos_token_id=2)


def test_llama_3_1_shape_with_legacy_rope_keys():
    config = model_config_from_dict(SHAPES["llama-3.1-8b"])
    assert (config.head_dim, config.num_key_value_heads, config.rope.theta) == (128, 8, 500000.0)
    assert config.rope.scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert (config.dtype, config.eos_token_ids, config.attention_bias) == ("bfloat16", [128001], False)


def test_transformers_5_rope_parameters_and_defaults():
    config = model_config_from_dict({**LLAMA, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert (config.rope.theta, config.rope.scaling) == (1e6, None)
    assert (config.num_key_value_heads, config.head_dim, config.dtype) == (32, 128, None)
    legacy = model_config_from_dict({**LLAMA, "rope_scaling": {"type": "llama3", "factor": 2.0}})
    assert (legacy.rope.theta, legacy.rope.scaling) == (10000.0, {"rope_type": "llama3", "factor": 2.0,
                                                                  "original_max_position_embeddings": 4096})


def test_qwen_flags():
    qwen2 = model_config_from_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"],
                                    "sliding_window": 1024, "use_sliding_window": False})
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    assert qwen2.sliding_window is None
    qwen3 = model_config_from_dict({**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 64})
    assert (qwen3.attention_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 64)


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM"):
        model_config_from_dict({**LLAMA, "architectures": ["GPT2LMHeadModel"]})


def test_a_sliding_window_does_not_limit_max_model_len():
    mistral = model_config_from_dict({**LLAMA, "architectures": ["MistralForCausalLM"],
                                      "max_position_embeddings": 32768, "sliding_window": 4096})
    assert (mistral.sliding_window, resolve_max_model_len(mistral, None)) == (4096, 32768)


def test_max_model_len_cannot_exceed_the_model():
    config = model_config_from_dict(LLAMA)
    assert resolve_max_model_len(config, None) == 4096
    with pytest.raises(ValueError, match=r"exceeds the model's max_position_embeddings \(4096\)"):
        resolve_max_model_len(config, 8192)


# vLLM's _get_and_verify_max_len: (rope scaling, default max_model_len, longest allowed).
ROPE_LENGTHS = {
    "yarn: original × factor": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
                                4096, 4096),
    "linear: max_position_embeddings × factor": ({"type": "linear", "factor": 2.0}, 8192, 8192),
    "dynamic: max_position_embeddings × factor": ({"rope_type": "dynamic", "factor": 2.0}, 8192, 8192),
    "llama3: max_position_embeddings": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
                                       4096, 4096),
    "longrope: original by default": ({"rope_type": "longrope", "short_factor": [1.0] * 64,
                                       "long_factor": [2.0] * 64, "original_max_position_embeddings": 1024},
                                      1024, 4096),
}


@pytest.mark.parametrize("case", ROPE_LENGTHS)
def test_rope_scaling_extends_max_model_len_as_vllm_does(case):
    scaling, default, longest = ROPE_LENGTHS[case]
    config = model_config_from_dict({**LLAMA, "rope_scaling": scaling})
    assert resolve_max_model_len(config, None) == default
    assert resolve_max_model_len(config, longest) == longest
    with pytest.raises(ValueError, match=f"--max-model-len {longest + 1} exceeds the model's max_position_embeddings"):
        resolve_max_model_len(config, longest + 1)


def test_gemma3_max_position_embeddings_counts_its_scaling_already():
    config = model_config_from_dict({**LLAMA, "model_type": "gemma3_text",
                                     "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert resolve_max_model_len(config, None) == 4096


def test_generation_config_eos_wins(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert load_model_config(tmp_path).eos_token_ids == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert load_model_config(tmp_path).eos_token_ids == [128001, 128009]


def test_missing_config_json_says_what_is_needed(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(tmp_path)


def test_rope_tables():
    cache = cos_sin_cache(Rope(8), 5)
    angles = torch.arange(5.0)[:, None] * 10000.0 ** (-torch.arange(0, 8, 2) / 8)
    torch.testing.assert_close(cache, torch.cat((angles.cos(), angles.sin()), dim=-1))
    with pytest.raises(ValueError, match="rope type 'mrope' is not supported"):
        cos_sin_cache(Rope(8, scaling={"rope_type": "mrope", "mrope_section": [1, 1, 2]}), 5)
