"""Anthropic Messages request and response bodies as msgspec Structs (docs.anthropic.com, Messages API)."""
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from pagedserve.gateway.schemas import MAX_MESSAGES, MAX_STOP_STRINGS


class _Block(Struct, tag_field="type", kw_only=True):
    cache_control: dict | None = None


class TextBlock(_Block, tag="text"):
    text: str
    citations: list | None = None


class ImageBlock(_Block, tag="image"):
    source: dict


class DocumentBlock(_Block, tag="document"):
    source: dict


class ToolUseBlock(_Block, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block, tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block, tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    data: str


InputBlock = (TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
              | RedactedThinkingBlock)


class MessageParam(Struct):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class ToolParam(Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict | None = None
    # Set on Anthropic's server tools (web_search_20250305, bash_20250124, ...); absent or "custom" on a
    # client's own tool.
    type: str | None = None
    cache_control: dict | None = None


class _ToolChoice(Struct, tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAuto(_ToolChoice, tag="auto"):
    pass


class ToolChoiceAny(_ToolChoice, tag="any"):
    pass


class ToolChoiceTool(_ToolChoice, tag="tool"):
    name: str


class ToolChoiceNone(_ToolChoice, tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingConfig(Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class JsonOutputFormat(Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict


class OutputConfig(Struct, kw_only=True):
    effort: str | None = None
    format: JsonOutputFormat | None = None


class CountTokensRequest(Struct, kw_only=True):
    """The body of /v1/messages/count_tokens: a messages request less its generation options."""
    model: str | None = None
    messages: Annotated[list[MessageParam], Meta(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    # Anthropic's SDK no longer sends the sampling fields; older clients (and LangChain) do.
    stop_sequences: Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    metadata: dict | None = None


class Usage(Struct):
    input_tokens: int
    output_tokens: int


class TextOut(Struct, tag_field="type", tag="text"):
    text: str


class ThinkingOut(Struct, tag_field="type", tag="thinking"):
    thinking: str
    # Anthropic's proof that it wrote the thinking; this server signs nothing, and clients send it back as is.
    signature: str = ""


class ToolUseOut(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentOut = TextOut | ThinkingOut | ToolUseOut


class Message(Struct, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[ContentOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


class CountTokensResponse(Struct):
    input_tokens: int


class MessageStart(Struct, tag_field="type", tag="message_start"):
    message: Message


class ContentBlockStart(Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentOut


class TextDelta(Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(Struct, tag_field="type", tag="signature_delta"):
    signature: str


class InputJsonDelta(Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockStop(Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(Struct):
    stop_reason: str
    stop_sequence: str | None


class DeltaUsage(Struct):
    output_tokens: int
    input_tokens: int | UnsetType = UNSET


class MessageDelta(Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: DeltaUsage


class MessageStop(Struct, tag_field="type", tag="message_stop"):
    pass


class Ping(Struct, tag_field="type", tag="ping"):
    pass


StreamEvent = (MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop
               | Ping)


class ErrorInfo(Struct):
    type: str
    message: str


class ErrorBody(Struct, tag_field="type", tag="error"):
    error: ErrorInfo


def event_name(event: msgspec.Struct) -> str:
    """The SSE `event:` line of a stream event: its type."""
    return type(event).__struct_config__.tag
