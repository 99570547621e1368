"""Logprobs, penalties and min_tokens through the offline LLM (scheduler + executor cores) on a tiny
model, against transformers: its log_softmax, its repetition and min-new-tokens processors, and a
frequency/presence processor written out below."""
import math
import random
from dataclasses import replace

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.executor_svc.logits import PROMPT_LOGPROBS_CHUNK
from tests.executor_svc.harness import logits_rows
from tests.tiny_models import make_tiny_model

ARCH = "LlamaForCausalLM"
PROMPTS = [[random.Random(n).randrange(3, 512) for _ in range(n)] for n in (5, 11, 23, 40)]


class FrequencyPresence(transformers.LogitsProcessor):
    """OpenAI's penalties over the generated tokens only (the prompt is the first prompt_len)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        outputs = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(ARCH, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # As the engine's requests ignore EOS; generate() would take it from here otherwise.
    model.generation_config.eos_token_id = None
    return model


def hf_generate(hf, prompt: list[int], max_new_tokens: int,
                processors: transformers.LogitsProcessorList | None = None, **options) -> list[int]:
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                           pad_token_id=0, **options)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                          logits_processor=processors)
    return out[0, len(prompt):].tolist()


def generate(llm: LLM, params: SamplingParams) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def test_logprobs_are_transformers_log_softmax_of_the_raw_logits(path, hf):
    llm = LLM(str(path))
    # On a GPU, Triton's fp32 dot products run at TF32 precision: near-ties in the top-k may swap.
    exact = llm.worker.device.type == "cpu"
    atol = 1e-4 if exact else 3e-2
    # Sampled at temperature 0.7: the logprobs still come from the unscaled logits.
    for params in (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5),
                   SamplingParams(temperature=0.7, seed=3, max_tokens=8, ignore_eos=True, logprobs=2)):
        for prompt, out in zip(PROMPTS, generate(llm, params)):
            assert len(out.logprobs) == len(out.token_ids) == 8
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
            expected = logits.float().log_softmax(-1)
            for i, (token, entries) in enumerate(zip(out.token_ids, out.logprobs)):
                top = expected[i].topk(params.logprobs)
                top_ids = top.indices.tolist()
                # vLLM's order: the sampled token, then the top ones (the sampled one only once).
                assert next(iter(entries)) == token
                for t, entry in entries.items():
                    torch.testing.assert_close(entry.logprob, expected[i, t].item(), atol=atol, rtol=0)
                # The entries hold the top-k and the sampled token, which is in it or below it.
                ours = sorted((e.logprob for e in entries.values()), reverse=True)[:params.logprobs]
                torch.testing.assert_close(torch.tensor(ours), top.values, atol=atol, rtol=0)
                if exact:
                    assert list(entries) == [token] + [t for t in top_ids if t != token]
                    assert [entries[t].rank for t in top_ids] == list(range(1, params.logprobs + 1))
                    assert entries[token].rank == int((expected[i] >= expected[i, token]).sum())
                if params.temperature == 0:
                    assert entries[token].rank == 1


def test_max_logprobs_bounds_what_a_request_may_ask_for_and_minus_one_is_the_whole_vocabulary(path, hf):
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\] \(the server's --max-logprobs\), got 21"):
        LLM(str(path)).generate(prompt, SamplingParams(max_tokens=1, logprobs=21), use_tqdm=False)
    vocab = hf.config.vocab_size
    llm = LLM(str(path), max_logprobs=-1)
    assert llm.worker.describe().max_logprobs == vocab
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=vocab, prompt_logprobs=vocab)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    every = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
    assert len(every) == 2 + len(PROMPTS[0]) - 1
    for entries in every:
        assert sorted(entries) == list(range(vocab))
        assert abs(sum(math.exp(e.logprob) for e in entries.values()) - 1) < 1e-4


def test_logprobs_mode_returns_raw_logits_or_the_processed_distribution(path, hf):
    prompt = PROMPTS[1]
    with torch.inference_mode():
        first = hf(torch.tensor([prompt])).logits[0, -1].float()
    llm = LLM(str(path), logprobs_mode="raw_logits")
    atol = 1e-4 if llm.worker.device.type == "cpu" else 3e-2
    raw = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)
    for t, entry in raw[0].outputs[0].logprobs[0].items():
        torch.testing.assert_close(entry.logprob, first[t].item(), atol=atol, rtol=0)
    # Sampled at temperature 0.5 from the top 3: those 3 carry log_softmax(logits / 0.5) over
    # themselves, the rest -inf.
    params = SamplingParams(temperature=0.5, top_k=3, seed=0, max_tokens=1, logprobs=5)
    out = LLM(str(path), logprobs_mode="processed_logprobs").generate(
        {"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    top3 = first.topk(3).indices
    expected = torch.full_like(first, -math.inf)
    expected[top3] = (first[top3] / 0.5).log_softmax(-1)
    assert out.token_ids[0] in top3.tolist()
    for t, entry in out.logprobs[0].items():
        torch.testing.assert_close(entry.logprob, expected[t].item(), atol=atol, rtol=0)
    assert sum(math.isfinite(e.logprob) for e in out.logprobs[0].values()) == 3


def test_no_logprobs_unless_asked(path):
    out = LLM(str(path)).generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2),
                                  use_tqdm=False)[0].outputs[0]
    assert out.logprobs is None


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_repetition_penalty_matches_transformers_and_repeats_less(path, hf):
    llm = LLM(str(path))
    plain = generate(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    penalised = generate(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                             repetition_penalty=1.8))
    for prompt, out in zip(PROMPTS, penalised):
        assert out.token_ids == hf_generate(hf, prompt, 24, repetition_penalty=1.8)
    assert [o.token_ids for o in plain] != [o.token_ids for o in penalised]
    assert sum(repeats(o.token_ids) for o in penalised) < sum(repeats(o.token_ids) for o in plain)


def frequency_presence_reference(hf, frequency: float, presence: float) -> list[list[int]]:
    return [hf_generate(hf, p, 24, processors=transformers.LogitsProcessorList(
        [FrequencyPresence(len(p), frequency, presence)])) for p in PROMPTS]


@pytest.mark.parametrize("engine", [
    {}, {"block_size": 4, "num_gpu_blocks_override": 32, "max_model_len": 128}],
    ids=["ample cache", "forced preemption"])
def test_frequency_and_presence_penalties_match_transformers(path, hf, engine):
    llm = LLM(str(path), enable_prefix_caching=False, **engine)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=0.5, repetition_penalty=1.0)
    # After a preemption the executor gets prompt and outputs again: num_prompt_tokens keeps the
    # outputs counted as outputs.
    assert [o.token_ids for o in generate(llm, params)] == frequency_presence_reference(hf, 1.5, 0.5)
    assert bool(llm.scheduler.num_preemptions) == bool(engine)


def test_rows_without_options_stay_untouched_next_to_rows_with_them(path, hf):
    llm = LLM(str(path))
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    penalised = replace(plain, frequency_penalty=1.5, presence_penalty=0.5)
    mixed = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                         [plain, penalised, replace(plain, logprobs=1), penalised], use_tqdm=False)
    mixed = [o.outputs[0] for o in mixed]
    alone = generate(llm, plain)
    reference = frequency_presence_reference(hf, 1.5, 0.5)
    assert [o.token_ids for o in mixed] == [alone[0].token_ids, reference[1], alone[2].token_ids,
                                            reference[3]]
    assert [o.logprobs is None for o in mixed] == [True, True, False, True]


def test_min_tokens_masks_an_eos_that_greedy_would_pick_first(path, hf, tmp_path):
    first = hf_generate(hf, PROMPTS[0], 1)[0]
    eos_path = make_tiny_model(ARCH, tmp_path, eos_token_id=first)
    llm = LLM(str(eos_path))
    prompt = {"prompt_token_ids": PROMPTS[0]}
    eager = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert eager.token_ids == [first] and eager.finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, min_tokens=6),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 6 and first not in held.token_ids[:6]
    assert held.token_ids == hf_generate(hf, PROMPTS[0], 10, min_new_tokens=6, eos_token_id=first)


def test_a_long_prompts_logprobs_take_a_chunk_of_positions_at_a_time(tmp_path):
    """SEC-12: a step's prompt logprobs never hold the logits of more than PROMPT_LOGPROBS_CHUNK
    positions, and chunking leaves them transformers' log_softmax."""
    prompt = [random.Random(7).randrange(3, 512) for _ in range(2 * PROMPT_LOGPROBS_CHUNK + 40)]
    path = make_tiny_model(ARCH, tmp_path, max_position_embeddings=len(prompt) + 8)
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=len(prompt))
    rows = logits_rows(llm.worker.model)
    [out] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                         use_tqdm=False)
    # The whole prompt in one step: its 1063 positions as 512 + 512 + 39, then the sampled row.
    assert rows == [PROMPT_LOGPROBS_CHUNK, PROMPT_LOGPROBS_CHUNK, 39, 1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    got = torch.tensor([lp[token].logprob for lp, token in zip(out.prompt_logprobs[1:], prompt[1:])])
    torch.testing.assert_close(got, expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])],
                               atol=1e-4, rtol=0)
