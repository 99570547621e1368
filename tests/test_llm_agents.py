"""Structured outputs, logit_bias and prompt logprobs through the offline LLM on the real default
model (SmolLM2-135M-Instruct), with async scheduling on: grammars constrain their own rows only,
and prompt logprobs are transformers' log_softmax of the same model's logits."""
import json
import re

import jsonschema
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.sampling_params import StructuredOutputsParams
from tests.real_model import smollm2_path, smollm2_transformers_model

CAR = {"type": "object", "additionalProperties": False, "required": ["brand", "electric", "doors"],
       "properties": {"brand": {"enum": ["vw", "bmw", "tesla"]}, "electric": {"type": "boolean"},
                      "doors": {"enum": [2, 4]}}}
FREE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 5, 8,",
                "The weather today", "My favourite colour is", "import numpy as", "Dear Sir or Madam,"]


@pytest.fixture(scope="module")
def llm():
    path = smollm2_path()
    engine = LLM(str(path), max_num_batched_tokens=64, async_scheduling=True, dtype="float32")
    assert engine.config.async_scheduling
    return engine


def free_params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.8, seed=seed, ignore_eos=True)


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list:
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


def test_constrained_rows_leave_their_neighbours_alone(llm):
    alone = run(llm, FREE_PROMPTS, [free_params(i) for i in range(8)])
    constrained = SamplingParams(max_tokens=40, temperature=0.8, seed=99,
                                 structured_outputs=StructuredOutputsParams(json=CAR))
    prompts, params = [], []
    for i, prompt in enumerate(FREE_PROMPTS):
        prompts += [prompt, "A car, as JSON:"]
        params += [free_params(i), constrained]
    mixed = run(llm, prompts, params)
    assert [m[0].token_ids for m in mixed[::2]] == [a[0].token_ids for a in alone]
    for outputs in mixed[1::2]:
        assert outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(outputs[0].text), CAR)


@pytest.mark.parametrize("constraint, check, temperature", [
    (StructuredOutputsParams(choice=["yes", "no"]), lambda text: text in ("yes", "no"), 1.0),
    (StructuredOutputsParams(regex=r"\d{3}-\d{4}"), lambda text: re.fullmatch(r"\d{3}-\d{4}", text), 1.0),
    (StructuredOutputsParams(grammar='root ::= "red" | "green" | "blue"'),
     lambda text: text in ("red", "green", "blue"), 1.0),
    # Free-form JSON has no end a sampling small model must reach; greedy, it closes the object.
    (StructuredOutputsParams(json_object=True), lambda text: isinstance(json.loads(text), dict), 0.0),
])
def test_every_kind_constrains_each_of_n_choices(llm, constraint, check, temperature):
    params = SamplingParams(n=2, max_tokens=40, temperature=temperature, seed=3, structured_outputs=constraint)
    [outputs] = run(llm, ["Reply with a JSON object:" if constraint.json_object else "Answer:"], [params])
    assert len(outputs) == 2
    for out in outputs:
        assert out.finish_reason == "stop" and check(out.text), out.text


def test_logit_bias_moves_the_greedy_choice(llm):
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    [[first]] = run(llm, ["The capital of France is"], [greedy])
    token = first.token_ids[0]
    [[banned]] = run(llm, ["The capital of France is"], [SamplingParams(max_tokens=1, temperature=0.0,
                                                                          logit_bias={token: -100})])
    assert banned.token_ids[0] != token
    [[forced]] = run(llm, ["The capital of France is"], [SamplingParams(max_tokens=3, temperature=0.0,
                                                                          logit_bias={1234: 100})])
    assert forced.token_ids == [1234] * 3


def test_allowed_token_ids_hold_the_output_to_them_in_their_rows_only(llm):
    allowed = llm.tokenizer.encode(" yes no maybe", add_special_tokens=False)
    prompts = ["Is the sky green?", "The capital of France is"]
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=5, allowed_token_ids=allowed),
              SamplingParams(max_tokens=6, temperature=0.0)]
    [[held], [free]] = run(llm, prompts, params)
    assert len(held.token_ids) == 6 and set(held.token_ids) <= set(allowed)
    [[alone]] = run(llm, prompts[1:], params[1:])
    assert free.token_ids == alone.token_ids and not set(free.token_ids) <= set(allowed)


def test_bad_words_keep_a_word_out_of_the_output(llm):
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    [[first]] = run(llm, ["The capital of France is"], [greedy])
    assert " Paris" in first.text
    params = SamplingParams(max_tokens=8, temperature=0.0, bad_words=["Paris"])
    [[kept_out]] = run(llm, ["The capital of France is"], [params])
    assert "Paris" not in kept_out.text and kept_out.token_ids[0] != first.token_ids[0]


def test_prompt_logprobs_are_transformers_log_softmax(llm):
    prompt = llm.tokenizer.encode("The capital of France is Paris, and the capital of Germany is Berlin.")
    # The chunk budget of 64 tokens splits a long prompt; the second request finds the first's
    # blocks in the prefix cache, which prompt logprobs must not use.
    long_prompt = prompt * 6
    outputs = llm.generate([{"prompt_token_ids": long_prompt}] * 2,
                           SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3), use_tqdm=False)
    with torch.inference_mode():
        expected = smollm2_transformers_model()(torch.tensor([long_prompt])).logits[0].log_softmax(-1)
    for out in outputs:
        lp = out.prompt_logprobs
        assert len(lp) == len(long_prompt) and lp[0] is None
        got = torch.tensor([lp[i][long_prompt[i]].logprob for i in range(1, len(long_prompt))])
        want = expected[torch.arange(len(long_prompt) - 1), torch.tensor(long_prompt[1:])]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        top = [[t for t, p in lp[i].items() if p.rank <= 3] for i in range(1, len(long_prompt))]
        assert all(expected[i - 1].topk(3).indices[0].item() in top[i - 1] for i in range(1, len(long_prompt)))


def test_constraints_survive_preemption():
    # 24 blocks of 4 tokens cannot hold six requests growing to ~40 tokens at once.
    llm = LLM(str(smollm2_path()), block_size=4, num_gpu_blocks_override=24, max_model_len=96,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=5, structured_outputs=StructuredOutputsParams(json=CAR))
    outputs = run(llm, ["A car, as JSON:"] * 6, [params] * 6)
    assert llm.scheduler.num_preemptions > 0
    for [out] in outputs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), CAR)
