"""OpenAI request and response bodies as msgspec Structs; decoding turns bad input into a 400."""
import functools
import re
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from pagedserve.common.sampling_params import MAX_CACHE_SALT_CHARS, RANGES, OutOfRange, Range, check_ranges
from pagedserve.common.log import get_logger, loggable
from pagedserve.gateway.errors import bad_request

log = get_logger(__name__)
# A body's ignored field names in one log line; a crafted body may hold thousands.
MAX_LOGGED_FIELDS = 32

Int32 = Annotated[int, Meta(ge=-2**31, le=2**31 - 1)]
# OpenAI's own limit on `messages`; checked while decoding, which then stops early.
MAX_MESSAGES = 2048
Stop = str | Annotated[list[str], Meta(max_length=4)]
# Stop strings a request may send on protocols that set no limit of their own (Anthropic's, Ollama's):
# a streamed choice checks every one at each token.
MAX_STOP_STRINGS = 16

# The engine's ranges, less where OpenAI's API allows less: up to 16 choices, temperature up to 2.
# Completions' logprobs and chat's top_logprobs go to the engine's --max-logprobs (20 by default) as
# in vLLM, not OpenAI's legacy 5 and 20: evaluation harnesses written against vLLM ask for more than 5.
# Each endpoint names logprobs its own way.
SAMPLING_RANGES = {name: allowed for name, allowed in RANGES.items() if name != "logprobs"} | {
    "n": Range(1, 16), "temperature": Range(0, 2, note="0 = greedy")}
CHAT_RANGES = SAMPLING_RANGES | {"max_completion_tokens": RANGES["max_tokens"],
                                 "top_logprobs": RANGES["logprobs"]}
COMPLETION_RANGES = SAMPLING_RANGES | {"logprobs": RANGES["logprobs"]}


class StreamOptions(Struct):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Struct, kw_only=True):
    name: str = "response"
    description: str | None = None
    # Its own name in the API; `schema` would shadow nothing in a Struct, but reads as a keyword.
    json_schema: dict | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(Struct, kw_only=True):
    """vLLM's `structured_outputs` extra: exactly one of these."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ContentPart(Struct):
    type: str
    text: str | None = None


class FunctionCallIn(Struct):
    name: str
    # A JSON string, as OpenAI sends it; some clients send the object itself.
    arguments: str | dict = "{}"


class ToolCallIn(Struct):
    function: FunctionCallIn
    id: str | None = None
    type: str = "function"


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


Messages = Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]


class SamplingFields(Struct, kw_only=True):
    """The generation options that chat and completions share (vLLM's extensions included)."""
    # Checked after decoding rather than by msgspec, so that the 400 says what SamplingParams would.
    ranges: ClassVar[dict[str, Range]] = SAMPLING_RANGES
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # OpenAI's spec lets n, stream and echo be null, meaning their defaults.
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's: the only tokens the output may hold.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output may not hold (common/bad_words.py).
    bad_words: list[str] | None = None
    # vLLM's beam search (gateway/beam_search.py): n beams, ranked by logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's, not implemented: refused when set (params.check_not_implemented).
    logits_processors: list[Any] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # Token id (as a string, OpenAI's form) -> bias in [-100, 100]; larger ones are clamped. Kept as raw
    # JSON until params.logit_bias has counted its entries: decoding a 4 MiB body's 150k entries
    # would hold the event loop for 20-50 ms, counting them takes under 1 ms.
    logit_bias: msgspec.Raw = msgspec.Raw()
    # vLLM's: top logprobs per prompt token.
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's older spellings of structured_outputs' kinds.
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None
    # vLLM's: only requests with the same salt share prefix-cache blocks (one per tenant, say).
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # vLLM's: under --scheduling-policy priority, lower runs first.
    priority: int = 0
    # vLLM's: the model reads only the prompt's last this many tokens (-1: the model's limit).
    truncate_prompt_tokens: int | None = None
    # vLLM's: logprobs name tokens as "token_id:N" (unset: --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the prompt's and each choice's token ids beside the text.
    return_token_ids: bool | None = None

    def __post_init__(self) -> None:
        if self.n is None:
            self.n = 1
        try:
            check_ranges(self, self.ranges)
        except OutOfRange as e:
            raise bad_request(str(e), param=e.param) from e


class ChatCompletionRequest(SamplingFields, kw_only=True):
    ranges: ClassVar[dict[str, Range]] = CHAT_RANGES
    messages: Messages
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Accepted; the parsers return every call the model writes.
    parallel_tool_calls: bool | None = None
    # OpenAI's: a chat template variable, as vLLM passes it (gpt-oss's templates read it); a
    # chat_template_kwargs entry of the same name wins.
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # OpenAI's, about its own storage, caching, tiers and abuse tracking: accepted, nothing to do here
    # (so that they are not logged as ignored); any type, as when they were dropped unread.
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    # vLLM's: the prompt ends inside the final message (set add_generation_prompt false), which the
    # model continues: an assistant's reply begun by the client.
    continue_final_message: bool = False
    # vLLM's: false leaves the thinking a --reasoning-parser splits off out of the reply.
    include_reasoning: bool = True
    # vLLM's: the reply starts with the final message's text where that message is the assistant's.
    echo: bool = False
    # Extra variables for the chat template (e.g. enable_thinking), and a template of the
    # request's own in place of the model's.
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    # vLLM's: documents a RAG chat template cites (its `documents` variable).
    documents: list[dict[str, str]] | None = None
    # vLLM's: add the tokenizer's special tokens (BOS) to the rendered chat; the template writes them.
    add_special_tokens: bool = False


class CompletionRequest(SamplingFields, kw_only=True):
    ranges: ClassVar[dict[str, Range]] = COMPLETION_RANGES
    prompt: str | Annotated[list[str | Int32 | list[Int32]], Meta(min_length=1)]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    # OpenAI's legacy option, which vLLM's V1 engine dropped too: only n itself (or 1) is taken.
    best_of: int | None = None


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's /tokenize: either `prompt` or `messages` (rendered with the chat template)."""
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Unset means vLLM's defaults: true for a prompt, false for messages (the template adds them).
    add_special_tokens: bool | None = None
    # vLLM's: each token's string in the vocabulary beside its id.
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[Int32]


_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def decode_request(body: bytes, kind: type[Struct]) -> Struct:
    """Parses a JSON body into `kind`, or raises a 400 naming the field at fault. Logs the top-level
    fields it ignores (vLLM warns of them too): a field a client thinks it set, and this server does
    not serve, shows in the log rather than nowhere."""
    try:
        decoded = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        match = _PATH.search(str(e))
        message = _PATH.sub("", str(e))
        param = match.group(1) if match else None
        raise bad_request(f"Invalid request: {message}" + (f" at `{param}`" if param else ""),
                          param=param or None) from e
    except msgspec.DecodeError as e:
        raise bad_request(f"The body is not valid JSON ({e}); send a JSON object, UTF-8 encoded, "
                          "without NaN or Infinity.") from e
    except RecursionError:
        raise bad_request("The body nests JSON arrays and objects too deeply; flatten it.") from None
    if isinstance(decoded, Struct):
        _log_ignored(body, type(decoded))
    return decoded


def _log_ignored(body: bytes, kind: type[Struct]) -> None:
    # The keys alone: values stay undecoded spans, about 1 ms for a 4 MB body, under 1 us for a chat's.
    keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw]).keys()
    ignored = sorted(keys - _field_names(kind))
    if ignored:
        log.warning("request_fields_ignored", fields=[loggable(name, 64) for name in ignored[:MAX_LOGGED_FIELDS]],
                    count=len(ignored))


@functools.cache
def _field_names(kind: type[Struct]) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(kind))


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Only with --enable-prompt-tokens-details (vLLM's), else absent (OpenAI's spec does not allow
    # null): cached_tokens tells a client whether someone else sent the same prefix lately.
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET


class FunctionCall(Struct):
    name: str
    arguments: str


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessageOut(Struct):
    content: str | None
    role: str = "assistant"
    refusal: None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    # Only with --reasoning-parser: the thinking, under vLLM's newer and older names.
    reasoning: str | None | UnsetType = UNSET
    reasoning_content: str | None | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(Struct):
    tokens: list[str]
    # Null for the first prompt token under `echo`.
    token_logprobs: list[float | None]
    # The most likely tokens of each position, with the sampled one (so up to logprobs + 1).
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Struct):
    """vLLM's entry of prompt_logprobs."""
    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatChoice(Struct):
    index: int
    message: ChatMessageOut
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: ChatLogprobs | None = None
    # Only with vLLM's return_token_ids, as are the prompt_token_ids below.
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    # Only with vLLM's prompt_logprobs.
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET


class DeltaFunction(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """One tool call's part in a chunk: index on every one; id, type and name on its first only."""
    index: int
    function: DeltaFunction
    id: str | None = None
    type: str | None = None


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: ChatLogprobs | None = None
    # The tokens this chunk's text came from (vLLM's return_token_ids).
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    # Absent unless include_usage; then null on every chunk but the last.
    usage: Usage | None | UnsetType = UNSET
    object: str = "chat.completion.chunk"
    # With return_token_ids, on each choice's opening chunk.
    prompt_token_ids: list[int] | UnsetType = UNSET


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: CompletionLogprobs | None = None
    # Only with vLLM's prompt_logprobs (on the first chunk of a stream).
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET
    # Only with vLLM's return_token_ids: the prompt's (on a stream's first chunk of the choice) and the
    # output's (a chunk's own).
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET
    object: str = "text_completion"


class Model(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "pagedserve"
    # vLLM's: for a LoRA adapter, the model it runs on.
    parent: str | None = None


class ModelList(Struct):
    data: list[Model]
    object: str = "list"


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | UnsetType = UNSET


class DetokenizeResponse(Struct):
    prompt: str
