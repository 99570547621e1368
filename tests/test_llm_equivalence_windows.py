"""Greedy tokens of the offline LLM equal transformers' for the models with sliding windows and
scaled ropes: Mistral with a window shorter than the prompts, Qwen2 with YaRN past its original
context and a window on its upper layer, Phi-3 with longrope and partial rotary, each under the
five scenarios of test_llm_equivalence."""
import pytest

from pagedserve import LLM
# The five scenarios, collected here again to run on this module's `model` fixture.
from tests.test_llm_equivalence import (NEW_TOKENS,  # noqa: F401
                                        test_ample_cache, test_chunked_prefill_under_a_small_token_budget,
                                        test_forced_preemption_with_block_size_4,
                                        test_preemption_and_prefix_caching_together,
                                        test_prefix_caching_with_shared_prefixes, tiny_model_case)
from tests.tiny_models import hf_greedy, llm_greedy, make_tiny_model, mixed_prompts

# YaRN stretches Qwen2's 32 original positions to 128: prompts and outputs run to 100.
QWEN2_YARN = dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                  use_sliding_window=True, sliding_window=12, max_window_layers=1)
# tiny_models gives Mistral a 12-token window, Phi-3 a 16-token one with longrope's short
# factors (every sequence here stays within its 256 original positions) and partial rotary.
CASES = {"mistral-window": ("MistralForCausalLM", {}),
         "qwen2-yarn-window-upper-layer": ("Qwen2ForCausalLM", QWEN2_YARN),
         "phi3-longrope-short": ("Phi3ForCausalLM", {})}


@pytest.fixture(scope="module", params=CASES)
def model(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    return tiny_model_case(arch, tmp_path_factory, **overrides)


def test_phi3_long_factors(tmp_path):
    # transformers takes longrope's long factors for a forward whose sequence passes
    # original_max_position_embeddings; pagedserve (as vLLM) for every sequence once
    # max_model_len passes it. With 2 original positions every forward of every prompt here
    # (3 tokens and up) is past it, so both use the long factors throughout.
    path = make_tiny_model("Phi3ForCausalLM", tmp_path, original_max_position_embeddings=2)
    prompts = mixed_prompts(2)
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=16, block_size=4)
    assert llm_greedy(llm, prompts, NEW_TOKENS) == hf_greedy(path, prompts, NEW_TOKENS)

