"""One choice's text as the message clients read: the reasoning (with --reasoning-parser), the
content, and the tool calls that the active tool parser finds in the answer. With neither (plain
options, as completions use), the whole text is content.

Streamed, each call gets its index on every fragment, and its id and name once, on its first;
later fragments carry arguments only (what the openai SDK, LangChain and Dify merge by). The
non-stream message is the same scan of the whole text, so the fragments add up to it."""
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.gateway.call_scan import ParsedCall, Scan
from pagedserve.gateway.output_events import Event, ReasoningDelta, TextDelta, ToolCallDelta
from pagedserve.gateway.reasoning import Format, Splitter
from pagedserve.gateway.schemas import FunctionCall, ToolCall
from pagedserve.gateway.tool_parsers import Scanner


@dataclass(slots=True)
class ChatOutputOptions:
    """How a request's choices are read: the tool scanner's factory (None: plain content), whether
    found calls finish with "tool_calls" (auto and required; a named choice keeps "stop", as OpenAI
    does), and the think tags of the reasoning to split off (None: none)."""
    tools: Callable[[], Scanner] | None = None
    finish_with_calls: bool = False
    reasoning: Format | None = None
    # The tool scanner reads tags that are special tokens ([TOOL_CALLS]), so the text keeps them.
    keep_special_tokens: bool = False


@dataclass(slots=True)
class Message:
    content: str | None
    tool_calls: list[ToolCall]
    reasoning: str | None


def _tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ChoiceOutput:
    """One choice's output read as it arrives (delta) or whole (message). The splitter and the tool
    scanner keep their place in `text`, and what went out is kept as positions in it, so a stream's
    cost is linear in its length."""
    options: ChatOutputOptions
    text: str = ""
    # Where the reasoning and the content sent so far end in `text`.
    reasoning_sent: int = 0
    content_sent: int = 0
    # Per call found so far: its id, and where its arguments sent so far end (ParsedCall.arguments).
    ids: list[str] = field(default_factory=list)
    args_sent: list[int] = field(default_factory=list)
    # Calls before this one are complete and sent in full.
    calls_done: int = 0
    splitter: Splitter | None = None
    scanner: Scanner | None = None

    def __post_init__(self) -> None:
        self._restart()

    def _restart(self) -> None:
        self.splitter = None if self.options.reasoning is None else Splitter(self.options.reasoning)
        self.scanner = None if self.options.tools is None else self.options.tools()

    def _parts(self, final: bool) -> tuple[tuple[int, int] | None, Scan]:
        """The reasoning's span (None without a reasoning parser), and the answer's scan."""
        think, answer = None, 0
        if self.splitter is not None:
            think, answer = self.splitter.split(self.text, final)
        if answer is None:
            return think, Scan(0, 0)
        if self.scanner is None:
            return think, Scan(answer, len(self.text))
        return think, self.scanner.scan(self.text, answer, final)

    def read(self, text: str, final: bool, choice: int = 0) -> list[Event]:
        """The new text as events of choice `choice`: reasoning, content and tool-call fragments."""
        # Extended through a local, which CPython does in place (see IncrementalDetokenizer).
        whole, self.text = self.text, ""
        whole += text
        self.text = whole
        think, scan = self._parts(final)
        events: list[Event] = []
        if think is not None and think[1] > max(think[0], self.reasoning_sent):
            events.append(ReasoningDelta(whole[max(think[0], self.reasoning_sent):think[1]], choice))
            self.reasoning_sent = think[1]
        if scan.end > max(scan.start, self.content_sent):
            events.append(TextDelta(whole[max(scan.start, self.content_sent):scan.end], choice))
            self.content_sent = scan.end
        events += self._call_deltas(scan.calls, choice)
        return events

    def _call_deltas(self, calls: list[ParsedCall], choice: int) -> list[ToolCallDelta]:
        deltas = []
        for index in range(self.calls_done, len(calls)):
            call = calls[index]
            if call.name is not None and (d := self._call_delta(index, call, choice)) is not None:
                deltas.append(d)
            if index == self.calls_done and call.complete and (call.name is None or index < len(self.ids)):
                self.calls_done += 1
        return deltas

    def _call_delta(self, index: int, call: ParsedCall, choice: int) -> ToolCallDelta | None:
        if index == len(self.ids):
            self.ids.append(_tool_call_id())
            self.args_sent.append(call.end)
            return ToolCallDelta(index, self.ids[index], call.name, call.arguments(self.text), choice)
        fragment = call.arguments(self.text, self.args_sent[index])
        if not fragment:
            return None
        self.args_sent[index] = call.end
        return ToolCallDelta(index, None, None, fragment, choice)

    def message(self, text: str) -> Message:
        """The whole output as a message; calls get the ids a stream would have sent."""
        self.text = text
        self._restart()
        think, scan = self._parts(final=True)
        calls = [call for call in scan.calls if call.name is not None]
        while len(self.ids) < len(calls):
            self.ids.append(_tool_call_id())
        tool_calls = [ToolCall(i, FunctionCall(c.name, c.arguments(text))) for i, c in zip(self.ids, calls)]
        content = text[scan.start:scan.end]
        reasoning_text = None if think is None else text[think[0]:think[1]]
        if (tool_calls or self.options.tools is not None or think is not None) and not content.strip():
            content = None
        return Message(content, tool_calls, reasoning_text)

    def finish_reason(self, reason: str) -> str:
        """"tool_calls" for a choice that stopped after calling tools, when the options say so."""
        return "tool_calls" if reason == "stop" and self.ids and self.options.finish_with_calls else reason
