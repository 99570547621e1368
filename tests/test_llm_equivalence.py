"""Greedy tokens from the offline LLM (scheduler + executor cores) equal transformers' generate,
also under forced preemption, chunked prefill and prefix caching."""
import random

import pytest

from pagedserve import LLM
from tests.tiny_models import PROMPT_LENS, hf_greedy, llm_greedy, make_tiny_model, mixed_prompts

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
NEW_TOKENS = 40


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(36)]
    return [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 5, 12, 20, 7, 3, 16, 9)]


def tiny_model_case(arch: str, tmp_path_factory, **overrides) -> tuple[str, dict, dict]:
    """A tiny model of `arch` (config.json `overrides` on top of tiny_models'), the prompts of the
    scenarios below (mixed lengths, and shared prefixes), and transformers' greedy tokens for
    them: what the `model` fixture of a file running these scenarios returns."""
    path = make_tiny_model(arch, tmp_path_factory.mktemp(arch), **overrides)
    prompts = {"mixed": mixed_prompts(0), "shared": shared_prefix_prompts(1)}
    expected = {k: hf_greedy(path, v, NEW_TOKENS) for k, v in prompts.items()}
    return str(path), prompts, expected


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    return tiny_model_case(request.param, tmp_path_factory)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return llm_greedy(llm, prompts, NEW_TOKENS)


def test_ample_cache(model):
    path, prompts, expected = model
    llm = LLM(path, enable_prefix_caching=False)
    assert generate(llm, prompts["mixed"]) == expected["mixed"]
    assert llm.scheduler.num_preemptions == 0


def test_forced_preemption_with_block_size_4(model):
    path, prompts, expected = model
    # The longest request needs 25 blocks of 4; 40 blocks cannot hold all eight at once.
    llm = LLM(path, block_size=4, num_gpu_blocks_override=40, max_model_len=128,
              enable_prefix_caching=False)
    assert generate(llm, prompts["mixed"]) == expected["mixed"]
    assert llm.scheduler.num_preemptions > 0
    assert llm.scheduler.num_free_blocks == llm.scheduler.block_manager.num_usable_blocks


def test_chunked_prefill_under_a_small_token_budget(model):
    path, prompts, expected = model
    llm = LLM(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert max(PROMPT_LENS) > 16
    assert generate(llm, prompts["mixed"]) == expected["mixed"]


def test_prefix_caching_with_shared_prefixes(model):
    path, prompts, expected = model
    # Two at a time, so later requests find the prefix blocks that earlier ones computed.
    llm = LLM(path, block_size=4, max_num_seqs=2, enable_prefix_caching=True)
    assert generate(llm, prompts["shared"]) == expected["shared"]
    assert llm.scheduler.prefix_cache_hits > 0


def test_preemption_and_prefix_caching_together(model):
    path, prompts, expected = model
    llm = LLM(path, block_size=4, num_gpu_blocks_override=40, max_num_batched_tokens=24, max_model_len=128,
              enable_prefix_caching=True)
    assert generate(llm, prompts["shared"]) == expected["shared"]
    assert llm.scheduler.num_preemptions > 0
