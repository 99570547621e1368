"""Turns a decoded OpenAI request into prompt token ids and SamplingParams, rejecting what cannot run."""
import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pagedserve.gateway.errors import bad_request, unsupported
from pagedserve.gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields, Tool
from pagedserve.common.tokenizer import RESERVED_VARIABLES, Tokenizer
from pagedserve.common import sampling_params as engine_params
from pagedserve.common.bad_words import bad_words_token_ids
from pagedserve.common.chat_template import final_text, text_parts
from pagedserve.common.sampling_params import (MAX_BAD_WORDS_TOKENS, MAX_LOGIT_BIAS_TOKENS, OutOfRange,
                                               SamplingParams, StructuredOutputsParams)

# bad_words a request may name, and their characters in all: each is tokenized twice (as text starts
# it and inside text), on the event loop.
MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS = 1024, 16 * 1024
# Text of one request (its prompts, or everything its chat template renders); past a million
# characters no context window of a served model is near, and tokenizing it alone takes seconds of CPU.
MAX_PROMPT_CHARS = 1_000_000
# A request's own chat template (with --trust-request-chat-template): real ones are 2-20 KB, and
# compiling one takes about 15 ms per KB here (64 KiB: 1 s, in the template worker, within its deadline).
MAX_REQUEST_TEMPLATE_CHARS = 65_536
_json = msgspec.json.Encoder()
# Characters of one stop string (vLLM sets no limit); the longest in common use is a few words. Each
# streamed choice keeps up to this much text back while it could still begin a stop.
MAX_STOP_CHARS = 1024


def check_chat_options(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("`top_logprobs` needs `logprobs: true`; set it or remove `top_logprobs`.",
                          param="top_logprobs")
    check_stream_options(req)
    check_not_implemented(req)


def check_completion_options(req: CompletionRequest) -> None:
    # Fill-in-the-middle needs the model's own FIM tokens; ignoring `suffix` would answer a different
    # question than the code-completion client asked (vLLM refuses it too).
    if req.suffix is not None:
        raise unsupported("`suffix` (fill-in-the-middle)", "suffix")
    if req.best_of not in (None, 1, req.n):
        raise unsupported("`best_of` other than `n` (sampling more choices to return the best)", "best_of")
    check_stream_options(req)
    check_not_implemented(req)


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """The engine's logprobs count: top_logprobs (default 0) when logprobs is true, else None."""
    return (req.top_logprobs or 0) if req.logprobs else None


def check_not_implemented(req: SamplingFields) -> None:
    """A 400 for vLLM's options this server lacks: ignored, they would return output the client did
    not ask for."""
    if req.logits_processors:
        raise unsupported("Custom logits processors", "logits_processors")


def check_stream_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("`stream_options` is only allowed when `stream` is true.", param="stream_options")


def _message_parts(m: ChatMessage, index: int) -> list[str] | None:
    """The message's text parts (a string is one); None for an assistant's null content."""
    content = m.content
    if content is None and m.role != "assistant":
        raise bad_request(f"`messages[{index}].content` is null; only assistant messages may leave their "
                          "content out. Send a string or a list of text parts.",
                          param=f"messages[{index}].content")
    if not isinstance(content, list):
        return None if content is None else [content]
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"Content parts of type '{part.type}' are not supported; send text parts "
                              "only.", param=f"messages[{index}].content")
    return [part.text for part in content]


def _message_text(m: ChatMessage, index: int) -> str | None:
    parts = _message_parts(m, index)
    return None if parts is None else "\n".join(parts)


def chat_echo(req: ChatCompletionRequest) -> str:
    """The text a chat reply starts with under vLLM's `echo`: the final message's, where it is the
    assistant's (a reply the client began, as continue_final_message continues it)."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant":
        return ""
    return _message_text(last, len(req.messages) - 1) or ""


def chat_role(req: ChatCompletionRequest, response_role: str) -> str:
    """The role a chat reply is written as: --response-role where the prompt opened a new turn, else
    the final message's, whose turn the reply continues (vLLM's rule)."""
    return response_role if req.add_generation_prompt else req.messages[-1].role


def _tool_calls(m: ChatMessage, index: int) -> list[dict]:
    """The assistant's calls as templates expect them: arguments as an object (vLLM does this),
    so that a template's `tojson` does not encode a string twice."""
    calls = []
    for j, call in enumerate(m.tool_calls):
        arguments = call.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise bad_request(f"The arguments of tool call {j} are not JSON ({e}); send a JSON object.",
                                  param=f"messages[{index}].tool_calls[{j}].function.arguments") from e
        calls.append({"id": call.id, "type": call.type,
                      "function": {"name": call.function.name, "arguments": arguments}})
    return calls


def _chat_message(m: ChatMessage, index: int, parts: list[str] | None) -> dict:
    message = {"role": m.role, "content": None if parts is None else "\n".join(parts)}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = _tool_calls(m, index)
        # OpenAI lets a message that calls tools have no content; templates concatenate it.
        message["content"] = message["content"] or ""
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning or m.reasoning_content
    if reasoning is not None:
        # Both names, as vLLM passes them: templates read either.
        message["reasoning"] = message["reasoning_content"] = reasoning
    return message


@dataclass(slots=True)
class ChatInput:
    """What a chat template renders: the messages and tools as templates take them, the extra
    variables, a request's own template (None: the server's), and how many characters they hold."""
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict[str, Any] | None
    template: str | None
    size: int
    # Whether the prompt ends inside the final message, for the model to continue it.
    continue_final: bool = False
    # Each message's text parts as sent (none for null content), for templates that take content
    # as parts; `messages` hold them joined by newlines.
    parts: list[list[str]] = field(default_factory=list)
    # vLLM's `documents`: what a RAG template (Command R's, Granite's) cites.
    documents: list[dict] | None = None

    def template_messages(self, content_format: str) -> list[dict]:
        """The messages in `content_format` (see chat_template.content_format): content as one
        string, or as a list of {"type": "text", "text": ...} parts, as vLLM passes them."""
        if content_format == "string":
            return self.messages
        return [{**m, "content": text_parts(parts)} for m, parts in zip(self.messages, self.parts)]

    def continued_text(self, content_format: str) -> str | None:
        """The text a continued final message ends with, in `content_format` (chat_template.final_text)."""
        return final_text(self.template_messages(content_format)[-1]["content"])


def chat_input(messages: list[ChatMessage], tools: list[Tool] | None, template_kwargs: dict[str, Any] | None,
               template: str | None, trust_template: bool, continue_final: bool = False,
               documents: list[dict] | None = None) -> ChatInput:
    """A chat's template input; a 400 for a request template the server does not trust or that is
    too long, for kwargs that would replace the template's own variables, and past MAX_PROMPT_CHARS
    in all (the number of messages was checked when the request was decoded)."""
    check_request_template(template, trust_template)
    reserved = sorted(RESERVED_VARIABLES.intersection(template_kwargs or ()))
    if reserved:
        raise bad_request(f"`chat_template_kwargs` may not set {', '.join(reserved)}: the server sets those "
                          "template variables itself; remove them.", param="chat_template_kwargs")
    parts = [_message_parts(m, i) for i, m in enumerate(messages)]
    rendered = [_chat_message(m, i, p) for i, (m, p) in enumerate(zip(messages, parts))]
    tool_dicts = None if not tools else [msgspec.to_builtins(t) for t in tools]
    size = (sum(_message_size(m) for m in rendered) + _json_size(tool_dicts) + _json_size(template_kwargs)
            + _json_size(documents) + len(template or ""))
    if size > MAX_PROMPT_CHARS:
        raise bad_request(f"The chat (its messages, tools, documents, chat_template_kwargs and chat_template) holds "
                          f"{size} characters; the limit is {MAX_PROMPT_CHARS} per request.", param="messages")
    return ChatInput(rendered, tool_dicts, template_kwargs, template, size, continue_final,
                     [p or [] for p in parts], documents)


def check_request_template(template: str | None, trusted: bool) -> None:
    if template is None:
        return
    if not trusted:
        raise bad_request("This server renders its own chat template only; remove `chat_template`, or start "
                          "the server with --trust-request-chat-template to accept a request's.",
                          param="chat_template")
    if len(template) > MAX_REQUEST_TEMPLATE_CHARS:
        raise bad_request(f"`chat_template` holds {len(template)} characters; the limit is "
                          f"{MAX_REQUEST_TEMPLATE_CHARS}.", param="chat_template")


def _message_size(message: dict) -> int:
    calls = message.get("tool_calls")
    return (len(message["content"] or "") + len(message.get("reasoning") or "")
            + (_json_size(calls) if calls else 0))


def _json_size(value: object) -> int:
    return 0 if value is None else len(_json.encode(value))


def check_prompt_chars(size: int, param: str) -> None:
    if size > MAX_PROMPT_CHARS:
        raise bad_request(f"`{param}` holds {size} characters; the limit is {MAX_PROMPT_CHARS} per request.",
                          param=param)


def split_prompts(prompt: str | list, param: str = "prompt") -> list[str] | list[list[int]]:
    """The prompts of a completions request (or the inputs of another, named `param`): texts, or
    token id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    kinds = {type(p) for p in prompt}
    if kinds == {int}:
        return [prompt]
    if kinds == {list}:
        return prompt
    if kinds == {str}:
        if not all(prompt):
            raise bad_request(f"The {param} is empty; send some text.", param=param)
        check_prompt_chars(sum(map(len, prompt)), param)
        return prompt
    raise bad_request(f"`{param}` must be a string, a list of strings, a list of token ids or a list of "
                      "lists of token ids, not a mix.", param=param)


def encode_prompts(tokenizer: Tokenizer, prompts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(p) for p in prompts]


def check_fan_out(num_prompts: int, n: int, limit: int) -> None:
    """400 when a request asks for more completions (prompts x n) than --max-client-batch-size."""
    if num_prompts * n > limit:
        raise bad_request(f"This request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} "
                          f"completions; the limit is {limit} per request (--max-client-batch-size). "
                          "Split it into smaller requests.", param="prompt" if num_prompts > 1 else "n")


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    for ids in prompts:
        if not ids:
            raise bad_request("The prompt is empty; send at least one token.", param="prompt")
        check_token_ids(ids, vocab_size, "prompt")


def check_logprobs(wanted: SamplingParams, max_logprobs: int) -> None:
    """A 400 for more top logprobs a token than the engine returns (its --max-logprobs)."""
    try:
        engine_params.check_logprobs(wanted, max_logprobs)
    except OutOfRange as e:
        raise bad_request(f"{e}.", param=e.param) from None


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} in `{param}` is out of vocabulary; ids must be in "
                          f"[0, {vocab_size}).", param=param)


def bad_words_ids(words: list[str] | None, tokenizer: Tokenizer) -> list[list[int]] | None:
    """`bad_words` as token id sequences (common/bad_words.py); a 400 past MAX_BAD_WORDS words or
    MAX_BAD_WORDS_CHARS characters, before tokenizing, or past the engine's MAX_BAD_WORDS_TOKENS ids."""
    if not words:
        return None
    chars = sum(map(len, words))
    if len(words) > MAX_BAD_WORDS or chars > MAX_BAD_WORDS_CHARS:
        raise bad_request(f"`bad_words` holds {len(words)} words of {chars} characters; the limits are "
                          f"{MAX_BAD_WORDS} words and {MAX_BAD_WORDS_CHARS} characters.", param="bad_words")
    ids = bad_words_token_ids(words, tokenizer)
    count = sum(map(len, ids))
    if count > MAX_BAD_WORDS_TOKENS:
        raise bad_request(f"`bad_words` make {count} token ids; the limit is {MAX_BAD_WORDS_TOKENS}.",
                          param="bad_words")
    return ids or None


def check_allowed_token_ids(ids: list[int] | None, vocab_size: int) -> None:
    if ids is None:
        return
    if not ids:
        raise bad_request("`allowed_token_ids` is empty, which allows no token; name at least one or leave it out.",
                          param="allowed_token_ids")
    check_token_ids(ids, vocab_size, "allowed_token_ids")


def logit_bias(raw: msgspec.Raw, vocab_size: int) -> dict[int, float] | None:
    """A request's logit_bias (raw JSON) as token id -> bias; a 400 past MAX_LOGIT_BIAS_TOKENS, which
    are counted before decoding (keys and values hold no colon), or for a key that is not a token id."""
    text = bytes(raw)
    if not text or text == b"null":
        return None
    if text.count(b":") > MAX_LOGIT_BIAS_TOKENS:
        raise bad_request(f"`logit_bias` has {text.count(b':')} entries; the limit is {MAX_LOGIT_BIAS_TOKENS}. To "
                          "allow only a few tokens, use structured outputs (`structured_outputs.choice` or a "
                          "regex).", param="logit_bias")
    try:
        bias = msgspec.json.decode(text, type=dict[int, float])
    except msgspec.ValidationError as e:
        raise bad_request(f"`logit_bias` must map token ids, written as strings, to numbers: {e}.",
                          param="logit_bias") from e
    bad = next((t for t in bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"`logit_bias` key {str(bad)[:20]!r} is not a token id; keys must be token ids in "
                          f"[0, {vocab_size}), written as strings.", param="logit_bias")
    return bias or None


def check_stop(stop: str | list[str] | None) -> None:
    for text in [stop] if isinstance(stop, str) else stop or ():
        if len(text) > MAX_STOP_CHARS:
            raise bad_request(f"A stop string holds {len(text)} characters; the limit is {MAX_STOP_CHARS}.",
                              param="stop")


def truncation(value: int | None, max_model_len: int) -> int | None:
    """How many tokens of each prompt or input to keep (the last ones), None for all: vLLM's
    truncate_prompt_tokens."""
    try:
        return engine_params.prompt_keep(value, max_model_len)
    except OutOfRange:
        raise bad_request(f"`truncate_prompt_tokens` is {value}; send -1 (the model's limit) or 1 to "
                          f"{max_model_len}, the model's maximum context length.",
                          param="truncate_prompt_tokens") from None


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


def max_tokens(asked: int | None, default: int | None, cap: int | None) -> int | None:
    """A request's output limit as vLLM's get_max_tokens sets it: its own, else the generation
    config's default, and at most `cap` (generation_config.max_tokens_cap); None lets the scheduler
    fill the context."""
    limits = [limit for limit in (default if asked is None else asked, cap) if limit is not None]
    return min(limits) if limits else None


# Fields whose None means the model's generation-config default, else SamplingParams'.
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty")


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    defaults: dict, structured: StructuredOutputsParams | None = None,
                    prompt_logprobs: int | None = None, bias: dict[int, float] | None = None,
                    bad_words: list[list[int]] | None = None) -> SamplingParams:
    """max_tokens None lets the scheduler fill the remaining context of each prompt; logprobs is the
    number of top logprobs per token (None: none); `defaults` stand in for omitted options;
    `structured` is the output's constraint; `bias` the logit_bias() of `req`. The ranges were
    checked when `req` was decoded."""
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens}).",
                          param="min_tokens")
    if structured is not None and req.ignore_eos:
        raise bad_request("`ignore_eos` would let a structured output run past its end; remove it.",
                          param="ignore_eos")
    given = ({name: value for name, value in defaults.items() if name in _DEFAULTED}
             | {name: getattr(req, name) for name in _DEFAULTED if getattr(req, name) is not None})
    return SamplingParams(
        n=req.n, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
        stop=[] if req.stop is None else req.stop, stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        structured_outputs=structured, allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words or [], bad_words_token_ids=bad_words, logit_bias=bias, **given)
