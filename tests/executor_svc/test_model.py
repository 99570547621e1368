import random

import pytest
import torch
import transformers

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.model_config import load_model_config, model_config_from_dict
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.models.llama import layer_windows
from tests.executor_svc.harness import paged_prefill_logits
from tests.tiny_models import ARCHITECTURES, make_tiny_model


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_model(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def test_prefill_logits_match_transformers(tiny_model):
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (7, 30, 1, 19)]
    ours = paged_prefill_logits(tiny_model, prompts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    for prompt, logits in zip(prompts, ours):
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0]
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_tied_embeddings_have_no_lm_head(tmp_path):
    path = make_tiny_model("Qwen2ForCausalLM", tmp_path)
    config = load_model_config(path)
    model = build_model(config, TorchAttentionBackend(), 64)
    names = {name for name, _ in model.named_parameters()}
    assert config.tie_word_embeddings and "lm_head.weight" not in names
    assert "model.layers.0.self_attn.qkv_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names


@pytest.mark.parametrize("config", [
    transformers.Qwen2Config(use_sliding_window=True, sliding_window=12, max_window_layers=2, num_hidden_layers=4),
    transformers.Qwen2Config(use_sliding_window=False, sliding_window=12, num_hidden_layers=4),
    transformers.Qwen2Config(use_sliding_window=True, sliding_window=12, num_hidden_layers=4,
                             layer_types=["sliding_attention", "full_attention"] * 2),
    transformers.Qwen3Config(use_sliding_window=True, sliding_window=8, max_window_layers=3, num_hidden_layers=4),
    transformers.MistralConfig(sliding_window=12, num_hidden_layers=4),
    transformers.Phi3Config(sliding_window=2047, num_hidden_layers=4),
], ids=["qwen2-max-window-layers", "qwen2-off", "qwen2-layer-types", "qwen3", "mistral", "phi3"])
def test_layer_windows_are_transformers(config):
    """Each layer's window is the one transformers' attention of that layer uses."""
    ours = layer_windows(model_config_from_dict({**config.to_dict(), "architectures": [_ARCH[config.model_type]]}))
    model = transformers.AutoModelForCausalLM.from_config(config.__class__(**{
        **config.to_dict(), "hidden_size": 16, "intermediate_size": 16, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 8, "pad_token_id": 0, "eos_token_id": 0}))
    assert ours == [_window(layer.self_attn, config) for layer in model.model.layers]


_ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
         "phi3": "Phi3ForCausalLM"}


def _window(attention, config) -> int | None:
    # Qwen's attention holds its own window; Mistral's and Phi-3's read the config's in forward.
    return getattr(attention, "sliding_window", getattr(config, "sliding_window", None))
