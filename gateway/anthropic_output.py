"""The neutral output events as an Anthropic message: content blocks (thinking, text, tool_use), the
stop reason and usage, whole or as Anthropic's stream events; and errors in Anthropic's shape."""
from collections.abc import Callable

from pagedserve.gateway import anthropic_schemas as wire
from pagedserve.gateway.anthropic_schemas import (ContentBlockDelta, ContentBlockStart, ContentBlockStop, ContentOut,
                                                  DeltaUsage, ErrorBody, ErrorInfo, InputJsonDelta, Message,
                                                  MessageDelta, MessageStart, MessageStop, Ping, StopDelta,
                                                  StreamEvent, TextOut, ThinkingDelta, ThinkingOut, ToolUseOut, Usage)
from pagedserve.gateway.errors import APIError
from pagedserve.gateway.output_events import (Collected, Event, Finish, Outcome, ReasoningDelta, Step, TextDelta,
                                              ToolCallDelta)
from pagedserve.gateway.schemas import ToolCall
from pagedserve.gateway.schemas import Usage as NeutralUsage
from pagedserve.gateway.tools import arguments_object


# Anthropic's error type for each status; 529 is its "overloaded", which this server sends as 503.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def stop(finish: Finish, called_tools: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence: tool_use whenever the model called a tool (a named
    tool_choice finishes with "stop" in chat's terms), stop_sequence naming the stop string matched."""
    if finish.reason == "length":
        return "max_tokens", None
    if called_tools or finish.reason == "tool_calls":
        return "tool_use", None
    if isinstance(finish.stop_reason, str):
        return "stop_sequence", finish.stop_reason
    return "end_turn", None


def usage(neutral: NeutralUsage) -> Usage:
    return Usage(neutral.prompt_tokens, neutral.completion_tokens)


def message(message_id: str, model: str, outcome: Outcome, neutral: NeutralUsage) -> Message:
    """The whole response of a request that is not streamed."""
    blocks: list[ContentOut] = []
    if outcome.reasoning:
        blocks.append(ThinkingOut(outcome.reasoning))
    if outcome.content:
        blocks.append(TextOut(outcome.content))
    blocks += [_tool_use(call) for call in outcome.tool_calls]
    reason, sequence = stop(outcome.finish, bool(outcome.tool_calls))
    return Message(message_id, model, blocks or [TextOut("")], reason, sequence, usage(neutral))


def _tool_use(call: ToolCall) -> ToolUseOut:
    return ToolUseOut(call.id, call.function.name, arguments_object(call.function.arguments))


def error_body(error: APIError) -> ErrorBody:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return ErrorBody(ErrorInfo(kind, error.info.message))


class MessageWire:
    """One response of /v1/messages (serving's Wire): whole, or as Anthropic's stream events. A stream
    opens a content block when the kind of output changes (or a tool call starts) and closes it before
    the next opens, so its blocks are the whole message's."""

    def __init__(self, message_id: str, model: str, usage: Callable[[], NeutralUsage]) -> None:
        self.id = message_id
        self._model = model
        # The generation's usage so far: message_start's input_tokens is the scheduler's prompt count,
        # there once the first output has arrived, which the stream waits for before it opens.
        self._usage = usage
        # The open block's kind ("text", "thinking", "tool_use"), and the blocks opened so far.
        self._open: str | None = None
        self._blocks = 0
        self._called = False
        self._finish: Finish | None = None
        # Text of nothing but spaces, held until more text comes (see _text).
        self._spaces = ""

    def openings(self) -> list[StreamEvent]:
        usage = Usage(self._usage().prompt_tokens, 0)
        return [MessageStart(Message(self.id, self._model, [], None, None, usage)), Ping()]

    def step(self, step: Step) -> list[StreamEvent]:
        return [out for event in step.events for out in self._events(event)]

    def closing(self, neutral: NeutralUsage) -> list[StreamEvent]:
        reason, sequence = stop(self._finish, self._called)
        return [MessageDelta(StopDelta(reason, sequence), DeltaUsage(neutral.completion_tokens, neutral.prompt_tokens)),
                MessageStop()]

    def error(self, error: APIError) -> ErrorBody:
        return error_body(error)

    def body(self, collected: Collected) -> Message:
        return message(self.id, self._model, collected.outcomes[0], collected.usage)

    def _events(self, event: Event) -> list[StreamEvent]:
        if isinstance(event, TextDelta) and event.text:
            return self._text(event.text)
        if isinstance(event, ReasoningDelta) and event.text:
            return (self._into("thinking", ThinkingOut(""))
                    + [ContentBlockDelta(self._blocks - 1, ThinkingDelta(event.text))])
        if isinstance(event, ToolCallDelta):
            self._spaces = ""
            return self._tool_call(event)
        if isinstance(event, Finish):
            self._finish = event
            if self._blocks:
                return self._close()
            # A message holds one block at least, as the whole one does.
            return [*self._into("text", TextOut("")), *self._text(self._spaces, final=True), *self._close()]
        return []

    def _text(self, text: str, final: bool = False) -> list[StreamEvent]:
        """Text opens a text block once it holds more than spaces: the whole message drops the spaces
        a model writes before its tool calls."""
        text, self._spaces = self._spaces + text, ""
        if self._open != "text" and not text.strip() and not final:
            self._spaces = text
            return []
        if not text:
            return []
        return self._into("text", TextOut("")) + [ContentBlockDelta(self._blocks - 1, wire.TextDelta(text))]

    def _tool_call(self, event: ToolCallDelta) -> list[StreamEvent]:
        opened = []
        if event.id is not None:
            self._called = True
            opened = [*self._close(), *self._open_block("tool_use", ToolUseOut(event.id, event.name, {}))]
        if not event.arguments_fragment:
            return opened
        return opened + [ContentBlockDelta(self._blocks - 1, InputJsonDelta(event.arguments_fragment))]

    def _into(self, kind: str, block: ContentOut) -> list[StreamEvent]:
        """Opens a block of `kind` unless one is open, closing the open block of another kind."""
        if self._open == kind:
            return []
        return [*self._close(), *self._open_block(kind, block)]

    def _open_block(self, kind: str, block: ContentOut) -> list[StreamEvent]:
        self._open = kind
        self._blocks += 1
        return [ContentBlockStart(self._blocks - 1, block)]

    def _close(self) -> list[StreamEvent]:
        if self._open is None:
            return []
        self._open = None
        return [ContentBlockStop(self._blocks - 1)]
