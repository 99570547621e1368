"""LLM.beam_search (vLLM's offline beam search) on a tiny float32 model against a beam search written
out below over transformers' log_softmax; on the default model, beams that end at the end of text."""
import math
import random

import pytest
import torch
import transformers

from pagedserve import LLM, BeamSearchParams, SamplingParams
from tests.tiny_models import make_tiny_model

PROMPTS = [[random.Random(n).randrange(3, 512) for _ in range(n)] for n in (6, 13)]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path))


def reference(hf, prompt: list[int], width: int, max_tokens: int, length_penalty: float) -> list[tuple]:
    """Each round: every beam's 2 x width likeliest next tokens (transformers' log_softmax), the width
    likeliest extensions live on; then ranked by summed logprob / length ** length_penalty. No end of text."""
    beams = [(prompt, 0.0)]
    for _ in range(max_tokens):
        grown = []
        for tokens, total in beams:
            with torch.inference_mode():
                logprobs = hf(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(2 * width)
            grown += [(tokens + [t], total + lp) for t, lp in zip(top.indices.tolist(), top.values.tolist())]
        beams = sorted(grown, key=lambda b: -b[1])[:width]
    return sorted(beams, key=lambda b: -b[1] / len(b[0]) ** length_penalty)


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (3, 0.5)])
def test_beams_are_those_of_a_search_over_transformers_logprobs(path, llm, width, length_penalty):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # On a GPU, Triton's fp32 dot products run at TF32 precision (2e-4 apart in 4 tokens' sum).
    atol = 1e-4 if llm.worker.device.type == "cpu" else 3e-2
    params = BeamSearchParams(beam_width=width, max_tokens=4, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(outputs) == len(PROMPTS)
    # One prompt at a time, the same beams.
    one_by_one = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in one_by_one] == [[s.tokens for s in o.sequences] for o in outputs]
    for prompt, output in zip(PROMPTS, outputs):
        expected = reference(hf, prompt, width, 4, length_penalty)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
        for seq, (_, total) in zip(output.sequences, expected):
            assert seq.cum_logprob == pytest.approx(total, abs=atol)
            # Each output token's round: its own logprob among the 2 x width likeliest.
            chosen = [lp[t].logprob for t, lp in zip(seq.tokens[len(prompt):], seq.logprobs)]
            assert math.fsum(chosen) == pytest.approx(seq.cum_logprob, abs=1e-5)
            assert all(len(lp) == 2 * width for lp in seq.logprobs)
            assert seq.finish_reason == "length" and seq.text is None


def test_a_beam_of_one_is_greedy_decoding(llm):
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    beams = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], BeamSearchParams(beam_width=1, max_tokens=5))
    for prompt, out, beam in zip(PROMPTS, greedy, beams):
        assert beam.sequences[0].tokens == prompt + out.outputs[0].token_ids


def test_a_beam_width_past_max_logprobs_is_refused(llm):
    with pytest.raises(ValueError, match=r"beam_width 11 needs the 22 likeliest tokens a step; it must be 1 to 10"):
        llm.beam_search({"prompt_token_ids": PROMPTS[0]}, BeamSearchParams(beam_width=11, max_tokens=2))


def test_beams_stop_at_the_context_and_a_prompt_past_it_is_refused(llm):
    room = 3
    prompt = [7] * (llm.max_model_len - room)
    sequences = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=10))[0].sequences
    assert [len(s.tokens) for s in sequences] == [llm.max_model_len] * 2
    with pytest.raises(ValueError, match="maximum context length"):
        llm.beam_search({"prompt_token_ids": [7] * llm.max_model_len}, BeamSearchParams(beam_width=2, max_tokens=4))
