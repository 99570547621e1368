"""Turns a decoded OpenAI request into prompt token ids and SamplingParams, rejecting what cannot run."""
from pagedserve.gateway.errors import bad_request, model_not_found, unsupported
from pagedserve.gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from pagedserve.common.tokenizer import ChatTemplateError, Tokenizer
from pagedserve.common.sampling_params import SamplingParams


def resolve_model(requested: str | None, served: str) -> str:
    if requested and requested != served:
        raise model_not_found(requested)
    return served


def check_chat_options(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("`top_logprobs` needs `logprobs: true`; set it or remove `top_logprobs`.",
                          param="top_logprobs")
    if req.tools:
        raise unsupported("Tool calling", "tools")
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request(f"'response_format' of type '{req.response_format.type}' is not supported "
                          "yet; only 'text' is. Remove `response_format`.", param="response_format")
    check_stream_options(req)


def check_completion_options(req: CompletionRequest) -> None:
    if req.echo and req.logprobs is not None:
        raise bad_request("Prompt logprobs (`echo` together with `logprobs`) are not supported yet; "
                          "remove `echo` or `logprobs`.", param="echo")
    check_stream_options(req)


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """The engine's logprobs count: top_logprobs (default 0) when logprobs is true, else None."""
    return (req.top_logprobs or 0) if req.logprobs else None


def check_stream_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("`stream_options` is only allowed when `stream` is true.", param="stream_options")


def _message_text(content: str | list | None, index: int) -> str | None:
    if not isinstance(content, list):
        return content
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"Content parts of type '{part.type}' are not supported; send text parts "
                              "only.", param=f"messages[{index}].content")
    return "\n".join(part.text for part in content)


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                add_special_tokens: bool = False) -> list[int]:
    """The templated chat's token ids; the template writes the special tokens (BOS included), so
    add_special_tokens=True would add them twice (vLLM's /tokenize offers it all the same)."""
    rendered = []
    for i, m in enumerate(messages):
        message = {"role": m.role, "content": _message_text(m.content, i)}
        if m.name is not None:
            message["name"] = m.name
        rendered.append(message)
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt)
    except ChatTemplateError as e:
        raise bad_request(f"Cannot build a prompt from these messages: {e}", param="messages") from e
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def completion_prompts(tokenizer: Tokenizer, prompt: str | list) -> tuple[list[list[int]], list[str | None]]:
    """Token ids of each prompt, and its text where the client sent text."""
    if isinstance(prompt, str):
        prompt = [prompt]
    kinds = {type(p) for p in prompt}
    if kinds == {int}:
        return [prompt], [None]
    if kinds == {list}:
        return prompt, [None] * len(prompt)
    if kinds == {str}:
        if not all(prompt):
            raise bad_request("The prompt is empty; send some text.", param="prompt")
        return [tokenizer.encode(p) for p in prompt], prompt
    raise bad_request("`prompt` must be a string, a list of strings, a list of token ids or a list of "
                      "lists of token ids, not a mix.", param="prompt")


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    for ids in prompts:
        if not ids:
            raise bad_request("The prompt is empty; send at least one token.", param="prompt")
        check_token_ids(ids, vocab_size, "prompt")


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} in `{param}` is out of vocabulary; ids must be in "
                          f"[0, {vocab_size}).", param=param)


def check_context(prompts: list[list[int]], max_tokens: int | None, max_model_len: int) -> None:
    """400 when a prompt plus the requested output does not fit the context window."""
    longest = max(len(p) for p in prompts)
    if max_tokens is None and longest >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your "
                          f"prompt contains {longest} input tokens, leaving no room for output. Please "
                          "reduce the length of the input prompt.", code="context_length_exceeded")
    if max_tokens is not None and longest + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{max_tokens} output tokens and your prompt contains at least {longest} input tokens, for "
            f"a total of at least {longest + max_tokens} tokens. Please reduce the length of the input "
            "prompt or the number of requested output tokens.", param="max_tokens",
            code="context_length_exceeded")


# Fields whose None means the model's generation-config default, else SamplingParams'.
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty")


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    defaults: dict) -> SamplingParams:
    """max_tokens None lets the scheduler fill the remaining context of each prompt; logprobs is the
    number of top logprobs per token (None: none); `defaults` stand in for omitted options. The
    ranges were checked when `req` was decoded."""
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens}).",
                          param="min_tokens")
    given = defaults | {name: getattr(req, name) for name in _DEFAULTED if getattr(req, name) is not None}
    return SamplingParams(
        n=req.n, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
        stop=[] if req.stop is None else req.stop, stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, **given)
