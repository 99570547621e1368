"""Gemma's configs read as transformers reads them (Hub configs that leave fields to its defaults,
legacy RoPE keys, a vision-language config's text_config), its checkpoints' names in both
layouts, and its norms' 1 + weight kept in float32 in a bf16 model."""
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from pagedserve import LLM, SamplingParams
from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.device import default_dtype
from pagedserve.executor_svc.layers.attention import layer_windows
from pagedserve.executor_svc.layers.rotary import cos_sin_cache, rope_from_config
from pagedserve.executor_svc.model_config import load_model_config, model_config_from_dict
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.weight_loader import load_weights
from tests.executor_svc.test_gguf import loaded
from tests.tiny_models import make_tiny_model

# google/gemma-3-4b-it's config.json, vision_config left out: its text_config leaves most fields
# to Gemma3TextConfig's defaults and writes RoPE the legacy way.
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
             "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
             "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                             "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024},
             "torch_dtype": "bfloat16"}
# google/gemma-2-9b's: no layer_types, both activation keys, the legacy rope_theta.
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": 50.0,
             "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
             "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
             "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
             "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0, "query_pre_attn_scalar": 256,
             "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32"}
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
GEMMA_FIELDS = ("layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping")


def transformers_table(text_config: transformers.PretrainedConfig, layer_type: str, positions: int) -> torch.Tensor:
    """transformers' cos and sin of a layer type's RoPE, as one [positions, head_dim] table."""
    x, ids = torch.zeros(1), torch.arange(positions)[None]
    if text_config.model_type == "gemma3_text":
        cos, sin = Gemma3RotaryEmbedding(text_config)(x, ids, layer_type)
    else:
        cos, sin = Gemma2RotaryEmbedding(text_config)(x, ids)
    half = cos.shape[-1] // 2
    return torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1)


@pytest.mark.parametrize("config_json, config_class", [(GEMMA3_4B, transformers.Gemma3Config),
                                                       (GEMMA2_9B, transformers.Gemma2Config)],
                         ids=["gemma-3-4b-it", "gemma-2-9b"])
def test_hub_configs_read_as_transformers_reads_them(config_json, config_class):
    reference = config_class(**config_json)
    text = reference.get_text_config()
    config = model_config_from_dict(config_json)
    assert config.architecture == config_json["architectures"][0]
    assert {f: getattr(config, f) for f in FIELDS} == {f: getattr(text, f) for f in FIELDS}
    assert {f: config.hf_config[f] for f in GEMMA_FIELDS} == {f: getattr(text, f) for f in GEMMA_FIELDS}
    assert config.hidden_act == text.hidden_activation == "gelu_pytorch_tanh"
    assert config.eos_token_ids == ([1, 106] if "text_config" in config_json else [1])
    assert layer_windows(config) == [text.sliding_window if kind == "sliding_attention" else None
                                     for kind in text.layer_types], "the window is the sliding layers' alone"
    for layer_type in ("sliding_attention", "full_attention"):
        ours = cos_sin_cache(rope_from_config(config.hf_config, layer_type), 64)
        torch.testing.assert_close(ours, transformers_table(text, layer_type, 64), rtol=0, atol=1e-6)


def test_an_embedding_gemma_is_refused():
    config = {**GEMMA3_4B["text_config"], "architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}
    with pytest.raises(ValueError, match="sets use_bidirectional_attention .* serves causal text generation"):
        model_config_from_dict(config)


def test_transformers_5_names_of_a_vision_language_checkpoint(tmp_path):
    """transformers 5 saves Gemma 3's text model as language_model.model.*; its own modules are
    named model.language_model.*, which other exporters write: both load alike."""
    path = make_tiny_model("Gemma3ForConditionalGeneration", tmp_path / "saved")
    tensors = load_file(path / "model.safetensors")
    assert any(name.startswith("language_model.model.") for name in tensors)
    renamed = {name.replace("language_model.model.", "model.language_model.")
               .replace("vision_tower.", "model.vision_tower."): t for name, t in tensors.items()}
    (tmp_path / "renamed").mkdir()
    save_file(renamed, tmp_path / "renamed" / "model.safetensors")
    (tmp_path / "renamed" / "config.json").write_text((path / "config.json").read_text())
    expected, weights = loaded(path).state_dict(), loaded(tmp_path / "renamed").state_dict()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(t, expected[name]) for name, t in weights.items())


def test_bf16_model_keeps_one_plus_weight_in_float32(tmp_path):
    path = make_tiny_model("Gemma3ForCausalLM", tmp_path, hidden_size=96, head_dim=24)
    weight = load_file(path / "model.safetensors")["model.layers.0.self_attn.q_norm.weight"]
    with default_dtype(torch.bfloat16):
        model = build_model(load_model_config(path), TorchAttentionBackend(), 64)
    load_weights(model, path, "auto")
    norm = model.model.layers[0].self_attn.q_norm.weight
    assert norm.dtype == torch.float32 and torch.equal(norm, 1.0 + weight.float())
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    # transformers' embed_scale, sqrt(96) in the model's dtype: 9.8125, not 9.798.
    assert model.model.embed_scale.dtype == torch.bfloat16 and model.model.embed_scale.item() == 9.8125


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_dummy_weights_give_finite_logprobs(tmp_path, arch):
    llm = LLM(str(make_tiny_model(arch, tmp_path)), load_format="dummy", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    [out] = llm.generate([{"prompt_token_ids": list(range(3, 40))}], params, use_tqdm=False)
    logprobs = [e.logprob for lp in out.prompt_logprobs[1:] + out.outputs[0].logprobs for e in lp.values()]
    assert len(logprobs) >= 36 + 4 and all(math.isfinite(lp) for lp in logprobs)
