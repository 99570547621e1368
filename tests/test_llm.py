"""The offline API on the default model (SmolLM2): text prompts, n > 1, stop strings, progress of outputs."""
import pytest

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256)


def test_text_and_token_prompts(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text_out, ids_out = llm.generate(
        ["Hello, how are you?", {"prompt_token_ids": llm.tokenizer.encode("Hello, how are you?")}],
        greedy, use_tqdm=False)
    assert text_out.prompt == "Hello, how are you?"
    assert text_out.prompt_token_ids == ids_out.prompt_token_ids
    assert len(text_out.outputs[0].token_ids) == 6
    assert text_out.outputs[0].token_ids == ids_out.outputs[0].token_ids
    assert text_out.outputs[0].text == llm.tokenizer.decode(text_out.outputs[0].token_ids)
    assert text_out.outputs[0].finish_reason == "length" and text_out.finished


def test_n_choices_with_a_seed_differ_and_repeat(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    first = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_stop_string_truncates_the_text(llm):
    prompt = "The quick brown fox"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2:][:3]
    assert stop.strip(), f"the model's greedy text {free.text!r} is too short for this test"
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[:free.text.index(stop)]
    assert llm.scheduler.num_running == 0 and not llm.scheduler.has_work()


@pytest.fixture(scope="module")
def llm_one_step_at_a_time():
    return LLM(max_model_len=256, async_scheduling=False)


def test_async_scheduling_gives_the_tokens_of_one_step_at_a_time(llm, llm_one_step_at_a_time):
    """Two steps in flight (the default) against one: every sampling feature, including the ones
    that make the executor settle the steps in flight first (penalties, min_tokens)."""
    prompts = ["Hello, how are you?", "The quick brown fox", "Once upon a time", "1, 2, 3,"] * 2
    eos = llm.runner.describe().eos_token_ids[0]
    params = [SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop=[" the"]),
              SamplingParams(temperature=0, max_tokens=15, repetition_penalty=1.3,
                             frequency_penalty=0.5, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=5, seed=11, max_tokens=10, min_tokens=6,
                             stop_token_ids=[eos]),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, presence_penalty=0.7)]

    def run(engine: LLM) -> list:
        return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in out.outputs]
                for out in engine.generate(prompts, params, use_tqdm=False)]

    assert run(llm) == run(llm_one_step_at_a_time)
    assert llm.config.async_scheduling and not llm.scheduler.has_work()
