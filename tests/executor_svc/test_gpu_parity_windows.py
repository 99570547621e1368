"""On a CUDA GPU, in bf16: test_gpu_parity's checks (first-step logits, greedy tokens with and
without CUDA graphs, against transformers) on the models with sliding windows and scaled ropes:
Mistral with a 12-token window, Qwen2 with YaRN to 256 positions and a window on its upper layer,
Phi-3 with longrope (short factors: every sequence stays within its 256 original positions),
partial rotary and a 16-token window."""
import pytest

# test_gpu_parity's fixtures and tests, collected here again on this module's `model_path`.
from tests.executor_svc.test_gpu_parity import (hf_model, prompts, pytestmark,  # noqa: F401
                                                test_first_step_logits_match_transformers_in_bf16,
                                                test_greedy_tokens_agree_with_transformers_in_bf16)
from tests.tiny_models import make_tiny_model

QWEN2_YARN = dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                  use_sliding_window=True, sliding_window=12, max_window_layers=1)
CASES = {"mistral-window": ("MistralForCausalLM", {}),
         "qwen2-yarn-window-upper-layer": ("Qwen2ForCausalLM", QWEN2_YARN),
         "phi3-longrope": ("Phi3ForCausalLM", {})}


@pytest.fixture(scope="module", params=CASES)
def model_path(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    return make_tiny_model(arch, tmp_path_factory.mktemp(request.param), **overrides)
