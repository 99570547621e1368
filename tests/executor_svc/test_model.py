import random

import pytest
import torch
import transformers

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.model_config import load_model_config, model_config_from_dict
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.layers import attention, mlp
from pagedserve.executor_svc.layers.attention import layer_windows
from pagedserve.executor_svc.layers.linear import (FUSED_ROWS, PROJECTION_ROWS, Linear, MergedLinear,
                                                   input_rows)
from tests.executor_svc.harness import paged_prefill_logits
from tests.tiny_models import ARCHITECTURES, make_tiny_model


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_model(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def assert_prefill_logits_match_transformers(model_dir: str, prompts: list[list[int]]) -> None:
    ours = paged_prefill_logits(model_dir, prompts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, logits in zip(prompts, ours):
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0]
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_prefill_logits_match_transformers(tiny_model):
    rng = random.Random(1)
    assert_prefill_logits_match_transformers(tiny_model, [[rng.randrange(512) for _ in range(n)]
                                                          for n in (7, 30, 1, 19)])


def test_padding_rows_before_o_proj_and_down_proj_leave_the_logits_unchanged(tiny_model, monkeypatch):
    # On a GPU their inputs have padding rows (linear.input_rows): here every step's do.
    for module in (attention, mlp):
        monkeypatch.setattr(module, "input_rows", lambda projection, num_tokens: num_tokens + 5)
    assert_prefill_logits_match_transformers(tiny_model, [[3, 14, 15, 92, 65], [35]])


def test_input_rows_pad_only_model_dtype_projections_on_a_gpu():
    row, fused = Linear(64, 32, bias=False), MergedLinear(32, {"gate_proj": 64, "up_proj": 64}, False)
    assert input_rows(row, 5) == 5 and input_rows(fused, 40) == 40
    if torch.cuda.is_available():
        row, fused = row.cuda(), fused.cuda()
        assert [input_rows(row, n) for n in (5, 32, 40)] == [PROJECTION_ROWS, 32, 40]
        assert [input_rows(fused, n) for n in (5, 32, 40, 64, 72)] == [5, 32, FUSED_ROWS, 64, 72]


def test_tied_embeddings_have_no_lm_head(tmp_path):
    path = make_tiny_model("Qwen2ForCausalLM", tmp_path)
    config = load_model_config(path)
    model = build_model(config, TorchAttentionBackend(), 64)
    names = {name for name, _ in model.named_parameters()}
    assert config.tie_word_embeddings and "lm_head.weight" not in names
    assert "model.layers.0.self_attn.qkv_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names


@pytest.mark.parametrize("config_class, fields", [
    (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=12, max_window_layers=2)),
    (transformers.Qwen2Config, dict(use_sliding_window=False, sliding_window=12)),
    (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=12,
                                    layer_types=["sliding_attention", "full_attention"] * 2)),
    (transformers.Qwen3Config, dict(use_sliding_window=True, sliding_window=8, max_window_layers=3)),
    (transformers.MistralConfig, dict(sliding_window=12)),
    (transformers.Phi3Config, dict(sliding_window=2047)),
    (transformers.Qwen2MoeConfig, dict(use_sliding_window=True, sliding_window=12, max_window_layers=3)),
    (transformers.Qwen3MoeConfig, dict(use_sliding_window=True, sliding_window=12, max_window_layers=3)),
    (transformers.MixtralConfig, dict(sliding_window=12)),
    (transformers.Gemma2Config, dict(sliding_window=12)),
    (transformers.Gemma3TextConfig, dict(sliding_window=12, sliding_window_pattern=3)),
], ids=["qwen2-max-window-layers", "qwen2-off", "qwen2-layer-types", "qwen3", "mistral", "phi3", "qwen2-moe",
        "qwen3-moe", "mixtral", "gemma2", "gemma3"])
def test_layer_windows_are_transformers(config_class, fields):
    """Each layer's window is the one transformers' attention of that layer uses, from a
    config.json with the `layer_types` transformers 5 writes and from one without them."""
    config = config_class(**fields, **TINY_LAYERS)
    written = {**config.to_dict(), "architectures": [_ARCH[config.model_type]]}
    without_types = {k: v for k, v in written.items() if k != "layer_types" or k in fields}
    model = transformers.AutoModelForCausalLM.from_config(config)
    theirs = [_window(layer.self_attn, config) for layer in model.model.layers]
    assert layer_windows(model_config_from_dict(written)) == theirs
    assert layer_windows(model_config_from_dict(without_types)) == theirs


# Four layers of the smallest shapes; two experts where the family has them.
TINY_LAYERS = dict(num_hidden_layers=4, hidden_size=16, intermediate_size=16, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8, vocab_size=8, pad_token_id=0, eos_token_id=0,
                   num_experts=2, num_local_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                   shared_expert_intermediate_size=8)
_ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
         "phi3": "Phi3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
         "mixtral": "MixtralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def _window(attention, config) -> int | None:
    # Qwen's and Gemma's attention holds its own window (Qwen2-MoE's none on a full layer, and 0
    # for none); Mistral's, Phi-3's and Mixtral's read the config's in forward.
    if config.model_type.startswith(("qwen", "gemma")):
        return getattr(attention, "sliding_window", None) or None
    return getattr(config, "sliding_window", None)
