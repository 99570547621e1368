"""One chat choice's text as the message clients read: the reasoning (with --reasoning-parser),
the content, and the tool calls that the active tool parser finds in the answer.

Streamed, each call gets its index on every delta, and its id, type and name once, on its first
delta; later deltas carry argument fragments only (what the openai SDK, LangChain and Dify merge
by). The non-stream message is the same scan of the whole text, so the fragments add up to it."""
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.gateway import reasoning
from pagedserve.gateway.schemas import Delta, DeltaFunction, DeltaToolCall, FunctionCall, ToolCall
from pagedserve.gateway.tool_parsers import Scan

ToolScan = Callable[[str, bool], Scan]


@dataclass(slots=True)
class ChatOutputOptions:
    """How a request's choices are read: the tool scan (None: plain content), whether found calls
    finish with "tool_calls" (auto and required; a named choice keeps "stop", as OpenAI does),
    and whether to split off the reasoning."""
    tools: ToolScan | None = None
    finish_with_calls: bool = False
    reasoning: bool = False


@dataclass(slots=True)
class Message:
    content: str | None
    tool_calls: list[ToolCall]
    reasoning: str | None


def _tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ChoiceOutput:
    options: ChatOutputOptions
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0
    # Per call found so far: its id, and how much of its arguments went out (-1: not announced).
    ids: list[str] = field(default_factory=list)
    args_sent: list[int] = field(default_factory=list)

    def _parts(self, final: bool) -> tuple[str | None, Scan]:
        think, answer = None, self.text
        if self.options.reasoning:
            think, answer = reasoning.split(self.text, final)
        if answer is None:
            return think, Scan("")
        if self.options.tools is None:
            return think, Scan(answer)
        return think, self.options.tools(answer, final)

    def delta(self, text: str, final: bool) -> Delta:
        """The new text as a delta: reasoning, content and tool-call fragments."""
        self.text += text
        think, scan = self._parts(final)
        delta = Delta()
        if think is not None and len(think) > self.reasoning_sent:
            delta.reasoning = delta.reasoning_content = think[self.reasoning_sent:]
            self.reasoning_sent = len(think)
        if len(scan.content) > self.content_sent:
            delta.content = scan.content[self.content_sent:]
            self.content_sent = len(scan.content)
        calls = [d for i, call in enumerate(scan.calls) if call.name is not None
                 and (d := self._call_delta(i, call.name, call.arguments)) is not None]
        delta.tool_calls = calls or None
        return delta

    def _call_delta(self, index: int, name: str, arguments: str) -> DeltaToolCall | None:
        if index == len(self.ids):
            self.ids.append(_tool_call_id())
            self.args_sent.append(0)
            self.args_sent[index] = len(arguments)
            return DeltaToolCall(index, DeltaFunction(name, arguments), self.ids[index], "function")
        if len(arguments) == self.args_sent[index]:
            return None
        fragment = arguments[self.args_sent[index]:]
        self.args_sent[index] = len(arguments)
        return DeltaToolCall(index, DeltaFunction(arguments=fragment))

    def message(self, text: str) -> Message:
        """The whole output as a message; calls get the ids a stream would have sent."""
        self.text = text
        think, scan = self._parts(final=True)
        calls = [call for call in scan.calls if call.name is not None]
        while len(self.ids) < len(calls):
            self.ids.append(_tool_call_id())
        tool_calls = [ToolCall(i, FunctionCall(c.name, c.arguments)) for i, c in zip(self.ids, calls)]
        content = scan.content
        if (tool_calls or self.options.tools is not None or think is not None) and not content.strip():
            content = None
        return Message(content, tool_calls, think)

    def finish_reason(self, reason: str) -> str:
        """"tool_calls" for a choice that stopped after calling tools, when the options say so."""
        return "tool_calls" if reason == "stop" and self.ids and self.options.finish_with_calls else reason
