"""The neutral output events as an Anthropic message: content blocks (thinking, text, tool_use), the
stop reason and usage, whole or as Anthropic's stream events. A stream opens one block at a time, in
the order the model writes them, so its blocks add up to the whole message's."""
from pagedserve.gateway.anthropic_schemas import (ContentBlockDelta, ContentBlockStart, ContentBlockStop, ContentOut,
                                                  DeltaUsage, InputJsonDelta, Message, MessageDelta, MessageStart,
                                                  MessageStop, Ping, StopDelta, StreamEvent, TextDelta, TextOut,
                                                  ThinkingDelta, ThinkingOut, ToolUseOut, Usage)
from pagedserve.gateway.output_events import Event, Finish, Outcome, ReasoningDelta, ToolCallDelta, UsageEvent
from pagedserve.gateway.output_events import TextDelta as NeutralText
from pagedserve.gateway.schemas import ToolCall
from pagedserve.gateway.tools import arguments_object
from pagedserve.gateway.schemas import Usage as NeutralUsage


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


class MessageStream:
    """One response's stream events, from the neutral events in order: a block opens when the kind of
    output changes (or a tool call starts) and closes before the next opens."""

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self._start = Message(message_id, model, [], None, None, Usage(input_tokens, 0))
        # The open block's index and kind ("text", "thinking", "tool_use"); blocks opened so far.
        self._open: str | None = None
        self._blocks = 0
        self._called = False
        self._finish: Finish | None = None

    def opening(self) -> list[StreamEvent]:
        return [MessageStart(self._start), Ping()]

    def events(self, event: Event) -> list[StreamEvent]:
        """The stream events that carry one neutral event."""
        if isinstance(event, NeutralText) and event.text:
            return self._into("text", TextOut("")) + [ContentBlockDelta(self._blocks - 1, TextDelta(event.text))]
        if isinstance(event, ReasoningDelta) and event.text:
            return (self._into("thinking", ThinkingOut(""))
                    + [ContentBlockDelta(self._blocks - 1, ThinkingDelta(event.text))])
        if isinstance(event, ToolCallDelta):
            return self._tool_call(event)
        if isinstance(event, Finish):
            self._finish = event
            return self._close() if self._blocks else [*self._into("text", TextOut("")), *self._close()]
        if isinstance(event, UsageEvent):
            return self._end(event.usage)
        return []

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

    def _end(self, neutral: NeutralUsage) -> list[StreamEvent]:
        reason, sequence = stop(self._finish, self._called)
        return [MessageDelta(StopDelta(reason, sequence), DeltaUsage(neutral.completion_tokens, neutral.prompt_tokens)),
                MessageStop()]
