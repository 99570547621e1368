"""--kv-cache-dtype fp8 on the CPU: a tiny model attending over an e4m3 KV cache stays close to the
same model over its float32 cache, and the pool holds twice the blocks of bf16 in the same bytes."""
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.reference import FP8_DTYPE
from tests.executor_svc.harness import make_worker, paged_prefill_logits, random_prompts
from tests.tiny_models import PROMPT_LENS, make_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


def test_prefill_logits_over_an_fp8_cache_stay_close(llama):
    prompts = random_prompts(list(PROMPT_LENS))
    exact = paged_prefill_logits(llama, prompts)
    fp8 = paged_prefill_logits(llama, prompts, kv_dtype=FP8_DTYPE)
    for a, b in zip(exact, fp8):
        assert not torch.equal(a, b)
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= 0.99


def test_llm_serves_with_an_fp8_cache(llama):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(list(PROMPT_LENS), seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        llm = LLM(str(llama), max_model_len=256, kv_cache_dtype=kv_cache_dtype)
        outputs[kv_cache_dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    auto, fp8 = outputs["auto"], outputs["fp8_e4m3"]
    assert all(len(tokens) == 8 for tokens in fp8)
    first_agree = sum(a[0] == b[0] for a, b in zip(auto, fp8))
    print(f"first tokens agreeing: {first_agree}/{len(prompts)}; all: {sum(a == b for a, b in zip(auto, fp8))}")
    assert first_agree >= len(prompts) - 1


def test_fp8_pool_holds_twice_the_blocks_of_bf16(llama):
    def worker(kv_cache_dtype: str):
        return make_worker(llama, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                           num_gpu_blocks_override=None, kv_cache_memory_bytes=1 << 20)

    auto, fp8 = worker("auto"), worker("fp8")
    assert fp8.describe().num_blocks == 2 * auto.describe().num_blocks == fp8.num_blocks
    # The scheduler sizes the background share of a step by the cache's element type.
    assert (fp8.describe().kv_cache_dtype, auto.describe().kv_cache_dtype) == ("float8_e4m3fn", "bfloat16")
    fp8_caches, auto_caches = fp8.runner.kv_caches, auto.runner.kv_caches
    assert fp8_caches[0][0].dtype == FP8_DTYPE and auto_caches[0][0].dtype == torch.bfloat16
    assert sum(k.nbytes + v.nbytes for k, v in fp8_caches) == sum(k.nbytes + v.nbytes for k, v in auto_caches)
