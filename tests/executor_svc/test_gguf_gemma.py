"""Gemma 2 and Gemma 3 GGUF files written as llama.cpp's converter writes them (norms stored as
1 + weight, no lm_head, Gemma 2 without a RoPE base) load into the configuration, weights and
greedy tokens of the Hugging Face checkpoint, reading what the file leaves out as llama.cpp does."""
from dataclasses import replace

import pytest
import torch

from pagedserve import LLM
from pagedserve.executor_svc.model_config import load_model_config
from tests.executor_svc.test_gguf import loaded
from tests.tiny_gguf import write_gguf
from tests.tiny_models import hf_greedy, llm_greedy, make_tiny_model, mixed_prompts

NEW_TOKENS = 24
# What llama.cpp assumes: queries scaled by head_dim (16 here), and for Gemma 3 one global
# layer in six.
MODELS = {"Gemma2ForCausalLM": dict(query_pre_attn_scalar=16),
          "Gemma3ForCausalLM": dict(query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=None)}
GEMMA_FIELDS = ("layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping")


@pytest.fixture(scope="module", params=MODELS)
def hf_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), **MODELS[request.param])


@pytest.fixture(scope="module")
def gguf_path(hf_dir):
    return write_gguf(hf_dir, hf_dir / "model.gguf")


def test_config_from_metadata_equals_config_json(hf_dir, gguf_path):
    expected, config = load_model_config(hf_dir), load_model_config(gguf_path)
    assert replace(config, hf_config={}) == replace(expected, hf_config={})
    assert {k: config.hf_config[k] for k in GEMMA_FIELDS} == {k: expected.hf_config[k] for k in GEMMA_FIELDS}
    # Gemma 3's global layers rotate by base 1e6 with linear scaling, its sliding ones by 10000.
    tables, expected_tables = (loaded(path).model.rotary_emb for path in (gguf_path, hf_dir))
    for kind in ("full", "sliding"):
        assert torch.equal(getattr(tables, kind), getattr(expected_tables, kind)), kind


def test_weights_equal_the_hf_checkpoint(hf_dir, gguf_path):
    expected, weights = loaded(hf_dir).state_dict(), loaded(gguf_path).state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_greedy_tokens_equal_transformers(hf_dir, gguf_path):
    prompts = mixed_prompts(0)
    llm = LLM(str(gguf_path), enable_prefix_caching=False, device="cpu", dtype="float32")
    assert llm_greedy(llm, prompts, NEW_TOKENS) == hf_greedy(hf_dir, prompts, NEW_TOKENS)


def test_27b_queries_scale_by_hidden_over_heads(tmp_path):
    # llama.cpp tells Gemma 2 27B by its 46 layers: its query_pre_attn_scalar is 4608 / 32.
    hf_dir = make_tiny_model("Gemma2ForCausalLM", tmp_path, num_hidden_layers=46, hidden_size=96)
    config = load_model_config(write_gguf(hf_dir, tmp_path / "model.gguf"))
    assert config.hf_config["query_pre_attn_scalar"] == 96 // 4
    assert config.hf_config["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
