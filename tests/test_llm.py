"""The offline API on the default model (SmolLM2): vLLM's keyword arguments, text prompts, chats,
n > 1, stop strings, progress of outputs."""
import pytest

from pagedserve import LLM, BeamSearchParams, SamplingParams


@pytest.fixture(scope="module")
def llm():
    # Keyword arguments as vLLM's examples pass them.
    return LLM(max_model_len=256, tensor_parallel_size=1, trust_remote_code=True, gpu_memory_utilization=0.5,
               dtype="float", seed=0)


def test_unset_batch_limits_take_vllms_offline_defaults_for_a_cpu(llm):
    assert (llm.config.max_num_seqs, llm.config.max_num_batched_tokens) == (256, 4096)
    assert llm.scheduler.max_num_seqs == 256 and llm.scheduler.max_num_batched_tokens == 4096


@pytest.mark.parametrize("kwargs, says", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0: must be a positive integer"),
    (dict(quantization="awq"), "quantization='awq': quantization other than fp8 is not built yet"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5: must be in (0, 1]"),
    (dict(max_num_seqs=0), "max_num_seqs=0: must be a positive integer"),
    (dict(dtype="int8"), "dtype='int8': choose from"),
    (dict(enforce_eager="yes"), "enforce_eager must be True or False"),
    (dict(max_model_length=4096), "LLM() takes no argument 'max_model_length'; did you mean max_model_len?"),
    (dict(fully_sharded_loras=True), "LLM(fully_sharded_loras=...): this LoRA option is not built"),
])
def test_unsupported_arguments_are_clear_errors(kwargs, says):
    with pytest.raises(ValueError) as refused:
        LLM("/never/loaded", **kwargs)
    assert says in str(refused.value)


def test_chat_renders_the_template_and_generates(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.chat(messages, greedy, use_tqdm=False)[0]
    prompt = llm.tokenizer.apply_chat_template(messages)
    assert out.prompt == prompt and out.prompt_token_ids == llm.tokenizer.encode(prompt, add_special_tokens=False)
    same = llm.generate({"prompt_token_ids": out.prompt_token_ids}, greedy, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].token_ids == same.outputs[0].token_ids
    two = llm.chat([messages, messages[1:]], greedy, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_takes_vllms_template_arguments(llm):
    one = SamplingParams(temperature=0, max_tokens=1)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hi\nthere"}]
    # SmolLM2's template takes content as a string: parts are joined, as the server joins them.
    assert llm.chat(parts, one, use_tqdm=False)[0].prompt == llm.chat(joined, one, use_tqdm=False)[0].prompt
    template = ("{{ flavor }}|{{ tools[0].name }}|{% for m in messages %}{% if m.content is string %}S:{{ m.content }}"
                "{% else %}{% for p in m.content %}P:{{ p.text }}{% endfor %}{% endif %}{% endfor %}")
    given = dict(chat_template=template, tools=[{"name": "search"}], chat_template_kwargs={"flavor": "x"},
                 add_generation_prompt=False, use_tqdm=False)
    assert llm.chat(parts, one, **given)[0].prompt == "x|search|P:HiP:there"
    assert llm.chat(parts, one, chat_template_content_format="string", **given)[0].prompt == "x|search|S:Hi\nthere"
    begun = [*joined, {"role": "assistant", "content": "Hello, I am"}]
    out = llm.chat(begun, one, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt.endswith("<|im_start|>assistant\nHello, I am")
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(begun, one, continue_final_message=True, use_tqdm=False)
    with pytest.raises(ValueError, match="choose from auto, string, openai"):
        llm.chat(joined, one, chat_template_content_format="list", use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    ids = llm.tokenizer.encode("Once upon a time, in a land far away, there lived a king")
    greedy = dict(temperature=0, max_tokens=3, ignore_eos=True)
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=5, **greedy), use_tqdm=False)[0]
    tail = llm.generate({"prompt_token_ids": ids[-5:]}, SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    whole = llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=-1, **greedy),
                         use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be in"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=0, **greedy), use_tqdm=False)


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


def test_a_stop_tokens_text_is_left_out_unless_asked_for_as_vllm_does(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    greedy = dict(temperature=0, max_tokens=40)
    free = llm.chat(chat, SamplingParams(**greedy, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    # EOS ends it, and its text is not output even where special tokens are.
    assert free.finish_reason == "stop" and free.stop_reason is None
    assert free.token_ids[-1] == llm.tokenizer.eos_token_id and llm.tokenizer.eos_token not in free.text
    stop = free.token_ids[len(free.token_ids) // 2]
    cut, kept = (llm.chat(chat, SamplingParams(**greedy, stop_token_ids=[stop], include_stop_str_in_output=k),
                          use_tqdm=False)[0].outputs[0] for k in (False, True))
    at = free.token_ids.index(stop)
    assert cut.token_ids == kept.token_ids == free.token_ids[:at + 1] and cut.stop_reason == stop
    assert cut.text == llm.tokenizer.decode(free.token_ids[:at])
    assert kept.text == llm.tokenizer.decode(free.token_ids[:at + 1])


@pytest.fixture(scope="module")
def llm_one_step_at_a_time():
    return LLM(max_model_len=256, async_scheduling=False, dtype="float")


def test_async_scheduling_gives_the_tokens_of_one_step_at_a_time(llm, llm_one_step_at_a_time):
    """Two steps in flight (the default) against one: every sampling feature, including the ones
    that make the executor settle the steps in flight first (penalties, min_tokens)."""
    prompts = ["Hello, how are you?", "The quick brown fox", "Once upon a time", "1, 2, 3,"] * 2
    eos = llm.worker.describe().eos_token_ids[0]
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


def test_priority_takes_one_per_prompt_and_needs_the_priority_policy(llm):
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match="needs --scheduling-policy priority"):
        llm.generate(["Hello"], params, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate(["Hello", "Hi"], params, use_tqdm=False, priority=[0])
    out = llm.generate(["Hello"], params, use_tqdm=False, priority=[0])[0]
    assert len(out.outputs[0].token_ids) == 2


def test_beam_search_ends_beams_at_the_end_of_text_and_ranks_them_by_length(llm):
    messages = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    eos = llm.tokenizer.eos_token_id
    for include in (False, True):
        params = BeamSearchParams(beam_width=2, max_tokens=12, include_stop_str_in_output=include)
        sequences = llm.beam_search({"prompt_token_ids": prompt}, params)[0].sequences
        assert len(sequences) == 2
        for seq in sequences:
            assert seq.finish_reason == "stop" and seq.tokens[-1] == eos and eos not in seq.tokens[len(prompt):-1]
            shown = seq.tokens[len(prompt):] if include else seq.tokens[len(prompt):-1]
            assert seq.text == llm.tokenizer.decode(shown, skip_special_tokens=False)
        # vLLM's ranking: summed logprob over the length, the prompt counted and the end of text not.
        scores = [seq.cum_logprob / (len(seq.tokens) - 1) for seq in sequences]
        assert scores == sorted(scores, reverse=True)
    assert sequences[0].text.endswith(llm.tokenizer.decode([eos], skip_special_tokens=False))
