"""The five equivalence scenarios of test_llm_equivalence (ample cache, forced preemption,
chunked prefill, prefix caching, preemption with prefix caching) on the mixture-of-experts
families: Qwen3-MoE, Qwen2-MoE (shared expert, a dense layer) and Mixtral."""
import pytest

from tests.test_llm_equivalence import (  # noqa: F401 (collected here, on this file's `model`)
    test_ample_cache, test_chunked_prefill_under_a_small_token_budget,
    test_forced_preemption_with_block_size_4, test_preemption_and_prefix_caching_together,
    test_prefix_caching_with_shared_prefixes, tiny_model_case)

ARCHS = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    return tiny_model_case(request.param, tmp_path_factory)
