"""The Responses API's bodies (/v1/responses) as msgspec Structs: the request, its input items, the
response object with its output items, and the stream's events (each tagged with its `type`)."""
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from pagedserve.common.sampling_params import RANGES, OutOfRange, Range, check_ranges
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.schemas import SAMPLING_RANGES

# OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA = 16
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
                     Meta(max_length=MAX_METADATA)]
# Input items of one request; as many as chat accepts messages.
MAX_INPUT_ITEMS = 2048


class Part(Struct, kw_only=True):
    """A content part of an input item: input_text/output_text (text), reasoning_text, or another
    type that this server refuses by name."""
    type: str
    text: str | None = None


class InputItem(Struct, kw_only=True):
    """One input item; which fields apply depends on `type` (a message may leave `type` out)."""
    type: str = "message"
    id: str | None = None
    # message
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    status: str | None = None
    # function_call
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    # function_call_output
    output: str | list[Part] | None = None
    # reasoning
    summary: list[Part] | None = None


class FunctionTool(Struct, kw_only=True):
    """A tool as the Responses API defines it: flat, `type` first ("function" is the only one served)."""
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(Struct, kw_only=True, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextOptions(Struct, kw_only=True):
    format: TextFormat = msgspec.field(default_factory=lambda: TextFormat(type="text"))
    verbosity: str | None = None


class ReasoningOptions(Struct, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


RESPONSES_RANGES = {name: SAMPLING_RANGES[name] for name in ("temperature", "top_p", "top_k", "seed")} | {
    "max_output_tokens": RANGES["max_tokens"], "top_logprobs": RANGES["logprobs"]}
# The `include` value that puts the output tokens' logprobs on output_text (with top_logprobs of each).
INCLUDE_LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(Struct, kw_only=True):
    ranges: ClassVar[dict[str, Range]] = RESPONSES_RANGES
    input: str | Annotated[list[InputItem], Meta(max_length=MAX_INPUT_ITEMS)]
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # vLLM's extensions.
    top_k: int | None = None
    seed: int | None = None
    metadata: Metadata | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    background: bool | None = False
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None

    def __post_init__(self) -> None:
        try:
            check_ranges(self, self.ranges)
        except OutOfRange as e:
            raise bad_request(str(e), param=e.param) from e


class OutputText(Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list = msgspec.field(default_factory=list)
    logprobs: list = msgspec.field(default_factory=list)


class ReasoningText(Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class FunctionCall(Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class Reasoning(Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    status: str
    content: list[ReasoningText]
    summary: list = msgspec.field(default_factory=list)


OutputItem = OutputMessage | FunctionCall | Reasoning


class InputTokensDetails(Struct):
    cached_tokens: int = 0
    # Prompt-cache writes are billed apart at OpenAI; this server has no such thing.
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(Struct):
    reason: str


class ErrorDetails(Struct):
    code: str
    message: str


class Response(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem]
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ReasoningOptions | None
    store: bool
    temperature: float | None
    text: TextOptions
    tool_choice: Any
    tools: list[FunctionTool]
    top_p: float | None
    background: bool = False
    # Absent until the output is complete.
    usage: ResponseUsage | UnsetType = UNSET
    error: ErrorDetails | None = None
    incomplete_details: IncompleteDetails | None = None
    completed_at: int | None = None
    truncation: str = "disabled"
    top_logprobs: int | None = None
    user: str | UnsetType = UNSET
    object: str = "response"


class DeletedResponse(Struct):
    id: str
    object: str = "response"
    deleted: bool = True


class InputItemList(Struct):
    data: list[dict]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


class StreamEvent(Struct, kw_only=True, tag_field="type"):
    """What every stream event carries: its type (the tag) and its place in the stream."""
    sequence_number: int


class ResponseCreated(StreamEvent, tag="response.created"):
    response: Response


class ResponseInProgress(StreamEvent, tag="response.in_progress"):
    response: Response


class ResponseCompleted(StreamEvent, tag="response.completed"):
    response: Response


class ResponseIncomplete(StreamEvent, tag="response.incomplete"):
    response: Response


class OutputItemAdded(StreamEvent, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(StreamEvent, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(StreamEvent, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(StreamEvent, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(StreamEvent, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list = msgspec.field(default_factory=list)


class OutputTextDone(StreamEvent, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list = msgspec.field(default_factory=list)


class ReasoningTextDelta(StreamEvent, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(StreamEvent, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDelta(StreamEvent, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(StreamEvent, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(StreamEvent, tag="error"):
    message: str
    code: str | None = None
    param: str | None = None
