"""On a CUDA GPU, in bf16: test_gpu_parity's checks (first-step logits, and greedy tokens with
and without CUDA graphs, against transformers') on tiny Gemma 2 and Gemma 3, whose windows (12 and
10 tokens) the prompts of up to 130 tokens outgrow: the Triton kernels' sliding windows,
soft-capping and GeGLU. On the CPU, bf16 runs of these models came within 1.2e-2 of
transformers' bf16 logits (Llama's within 1.0e-2), under the test's 2e-2.

Open: on an H200 (2026-12-02, f085088) these checks failed for Gemma 2 (first-step logits 5.38e-2
off transformers' on a 3-token prompt, and the greedy agreement), for Gemma 3's first-step logits
and for the head-dim-256 model, while the Llama, windowed and MoE checks passed. The cause is not
found: the Triton path run in float32 under the interpreter matches the references to 4e-7."""
import pytest
import torch

from tests.executor_svc.test_gpu_parity import (hf_model, prompts,  # noqa: F401
                                                test_first_step_logits_match_transformers_in_bf16,
                                                test_greedy_tokens_agree_with_transformers_in_bf16)
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# name -> (architecture, config overrides): besides the tiny models' head_dim of 16, Gemma-2-9B's
# 256 (and its query scale) in the attention kernels' tiles.
MODELS = {"gemma2": ("Gemma2ForCausalLM", {}), "gemma3": ("Gemma3ForCausalLM", {}),
          "gemma2-head-dim-256": ("Gemma2ForCausalLM", dict(num_attention_heads=2, num_key_value_heads=1,
                                                            head_dim=256, query_pre_attn_scalar=256))}


@pytest.fixture(scope="module", params=MODELS)
def model_path(request, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    return make_tiny_model(arch, tmp_path_factory.mktemp(request.param), **overrides)
