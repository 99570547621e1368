"""Gemma 2 and Gemma 3 through the offline LLM give transformers' greedy tokens under the five
scenarios of test_llm_equivalence (their sliding windows, 12 and 10 tokens, are shorter than the
prompts and cross block and chunk boundaries); Gemma 3's vision-language checkpoint serves its
text model; logprobs, sampled and prompt ones, are transformers' soft-capped ones."""
import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests.test_llm_equivalence import (test_ample_cache,  # noqa: F401
                                        test_chunked_prefill_under_a_small_token_budget,
                                        test_forced_preemption_with_block_size_4,
                                        test_preemption_and_prefix_caching_together,
                                        test_prefix_caching_with_shared_prefixes, tiny_model_case)
from tests.tiny_models import hf_greedy, llm_greedy, make_tiny_model, mixed_prompts

ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    return tiny_model_case(request.param, tmp_path_factory)


def test_vision_language_checkpoint_serves_its_text_model(tmp_path, capfd):
    path = make_tiny_model("Gemma3ForConditionalGeneration", tmp_path)
    prompts = mixed_prompts(2)[::2]
    llm = LLM(str(path), enable_prefix_caching=False)
    assert llm_greedy(llm, prompts, 16) == hf_greedy(path, prompts, 16)
    logged = capfd.readouterr()
    skipped = [line for line in (logged.out + logged.err).splitlines() if "vision_weights_skipped" in line]
    assert len(skipped) == 1 and "tensors=" in skipped[0]


def test_logprobs_are_transformers_soft_capped_ones(tmp_path):
    path = make_tiny_model("Gemma2ForCausalLM", tmp_path)
    prompt = mixed_prompts(3)[-1]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    [out] = LLM(str(path)).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt + tokens])).logits[0, :-1].log_softmax(-1)
    # Soft-capped at 6: every logit in (-6, 6), so no logprob below -12 - log(vocab size).
    assert expected.min() > -12 - torch.log(torch.tensor(512.0))
    ids = prompt[1:] + tokens
    got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    got += [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
    torch.testing.assert_close(torch.tensor(got), expected[torch.arange(len(ids)), torch.tensor(ids)],
                               atol=1e-4, rtol=0)
