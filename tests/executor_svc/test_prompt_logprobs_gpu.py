"""On a GPU (SEC-12): 20 prompt logprobs of a prompt that fills a step's token budget, at
--gpu-memory-utilization 0.95 on the Llama-3.1-8B shape. The step succeeds and the device's peak
stays inside the budget, which the memory profile shared out between the model's peak and the KV
cache. Computed in one pass, that prompt's [8191, 128256] float32 logits and their log_softmax
alone took 8.4 GB, more than the 5% of an H200 left outside the budget."""
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.model_shapes import write_shape

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
UTILIZATION = 0.95
BUDGET_TOKENS = 8192


def test_prompt_logprobs_of_a_full_token_budget_stay_in_the_memory_budget():
    llm = LLM(write_shape("llama-3.1-8b"), load_format="dummy", gpu_memory_utilization=UTILIZATION,
              max_model_len=BUDGET_TOKENS, max_num_batched_tokens=BUDGET_TOKENS)
    prompt = [random.Random(0).randrange(128000) for _ in range(BUDGET_TOKENS - 1)]
    torch.cuda.reset_peak_memory_stats()
    [out] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=20),
                         use_tqdm=False)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    free, total = torch.cuda.mem_get_info()
    # CUDA context, cuBLAS workspaces: in the budget too, outside torch's allocator.
    outside_torch = total - free - torch.cuda.memory_reserved()
    peak = torch.cuda.max_memory_allocated() + outside_torch
    print(f"peak {peak / 2**30:.2f} GiB of a {UTILIZATION * total / 2**30:.2f} GiB budget")
    assert peak <= UTILIZATION * total
