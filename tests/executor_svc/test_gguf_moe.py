"""GGUF files of the mixture-of-experts families, converted as llama.cpp's converter does
(qwen3moe, qwen2moe with its shared expert, Mixtral as llama with experts; each layer's experts
stacked as ffn_{gate,up,down}_exps): their config, weights and greedy tokens are the Hugging Face
checkpoint's."""
import pytest

from pagedserve.executor_svc.model_config import load_model_config
from tests.executor_svc.test_gguf import (  # noqa: F401 (collected here, on this file's `hf_dir`)
    test_greedy_tokens_equal_transformers, test_weights_equal_the_hf_checkpoint)
from tests.tiny_gguf import write_gguf
from tests.tiny_models import make_tiny_model

ARCHS = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
# config.json's expert fields a GGUF file carries (Mixtral's experts are intermediate_size wide).
EXPERT_FIELDS = ("num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size",
                 "shared_expert_intermediate_size")


@pytest.fixture(scope="module", params=ARCHS)
def hf_dir(request, tmp_path_factory):
    # llama.cpp makes every layer of a qwen2moe model sparse.
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), mlp_only_layers=[])


def test_config_from_metadata_has_the_experts_of_config_json(hf_dir, tmp_path):
    expected = load_model_config(hf_dir)
    config = load_model_config(write_gguf(hf_dir, tmp_path / "model.gguf"))
    assert config.architecture == expected.architecture
    hf, gguf = expected.hf_config, config.hf_config
    assert gguf["num_experts"] == hf.get("num_experts", hf.get("num_local_experts"))
    for field in EXPERT_FIELDS:
        # Mixtral's config has no norm_topk_prob: it always renormalizes, as llama.cpp does.
        assert gguf.get(field) == hf.get(field, True if field == "norm_topk_prob" else None), field
