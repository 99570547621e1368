"""Gemma 2 under -tp 2 on gloo gives transformers' greedy tokens, preemption and prefix caching
included: its vocab-parallel embedding is scaled after the ranks' rows are summed, its replicated
(1 + w) norms load on both ranks, and its soft-capped logits are capped once gathered."""
from pagedserve import LLM
from tests.test_tensor_parallel import NEW_TOKENS, SMALL_POOL, generate_all, keep_torch_threads  # noqa: F401
from tests.test_llm_equivalence import shared_prefix_prompts
from tests.tiny_models import hf_greedy, make_tiny_model, mixed_prompts


def test_gemma2_tp2_gives_transformers_greedy_tokens(tmp_path):
    path = make_tiny_model("Gemma2ForCausalLM", tmp_path)
    llm = LLM(str(path), tensor_parallel_size=2, **SMALL_POOL)
    assert generate_all(llm) == {"mixed": hf_greedy(path, mixed_prompts(0), NEW_TOKENS),
                                 "shared": hf_greedy(path, shared_prefix_prompts(1), NEW_TOKENS)}
    assert llm.scheduler.num_preemptions > 0 and llm.scheduler.prefix_cache_hits > 0
