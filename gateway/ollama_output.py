"""The neutral output events as Ollama's replies: /api/chat's message pieces or /api/generate's
response pieces, one NDJSON line each, then a `done` line with the reason, durations and token
counts; or all of it in one object when not streamed. Ollama sends a tool call whole, its arguments
an object, so a call goes out once the next one starts or the output ends."""
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from msgspec import UNSET, Struct

from pagedserve.gateway.errors import APIError
from pagedserve.gateway.logprobs import TokenLogprob
from pagedserve.gateway.ollama_schemas import (ChatChunk, ErrorBody, FunctionCall, GenerateChunk, Logprob,
                                               MessageOut, ToolCall)
from pagedserve.gateway.ollama_schemas import TokenLogprob as OllamaTokenLogprob
from pagedserve.gateway.output_events import Collected, Event, Finish, ReasoningDelta, Step, TextDelta, ToolCallDelta
from pagedserve.gateway.schemas import Usage
from pagedserve.gateway.tools import arguments_object


def done_reason(finish: Finish) -> str:
    """"length" when max_tokens (num_predict) ended it, else "stop", tool calls included (as Ollama)."""
    return "length" if finish.reason == "length" else "stop"


def error_body(error: APIError) -> ErrorBody:
    """An error in Ollama's shape: {"error": "<message>"}."""
    return ErrorBody(error.info.message)


def timestamp(seconds: float | None = None) -> str:
    """A Unix time (None: now) as Ollama writes times: ISO 8601 in UTC, with a Z."""
    moment = datetime.now(timezone.utc) if seconds is None else datetime.fromtimestamp(seconds, timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


@dataclass(slots=True)
class Clock:
    """When the request arrived and when its first output came, in perf_counter nanoseconds."""
    start: int = field(default_factory=time.perf_counter_ns)
    first: int | None = None

    def mark(self) -> None:
        if self.first is None:
            self.first = time.perf_counter_ns()

    def stats(self, usage: Usage) -> dict[str, int]:
        """The done line's durations (nothing loads here: the model is always in memory) and counts.
        Unstreamed, the first output is not seen: all the time counts as eval_duration, which clients
        divide eval_count by."""
        now = time.perf_counter_ns()
        first = self.start if self.first is None else self.first
        return dict(total_duration=now - self.start, load_duration=0, prompt_eval_count=usage.prompt_tokens,
                    prompt_eval_duration=first - self.start, eval_count=usage.completion_tokens,
                    eval_duration=now - first)


def _logprobs(tokens: list[TokenLogprob]) -> list[Logprob]:
    return [Logprob(t.token, t.logprob, [OllamaTokenLogprob(text, p) for _, text, p in t.top] or UNSET) for t in tokens]


class Replies:
    """One request's reply (serving's Wire), /api/chat's (`chat`) or /api/generate's: whole, or as
    NDJSON lines from the neutral events in order."""

    def __init__(self, reply_id: str, model: str, chat: bool, clock: Clock, logprobs: bool = False) -> None:
        self.id = reply_id
        self._model = model
        self._chat = chat
        self._clock = clock
        self._logprobs = logprobs
        # Logprobs of tokens whose text has not gone out yet (held back, or a tool call's).
        self._held: list[Logprob] = []
        # The tool calls begun and not yet sent: their names and argument fragments so far.
        self._calls: list[tuple[str, list[str]]] = []
        self._finish: Finish | None = None
        # Text of nothing but spaces, held until more text comes (see _text), and whether any went out.
        self._spaces = ""
        self._texted = False

    def line(self, content: str = "", thinking: str | None = None, calls: list[ToolCall] | None = None,
             end: dict | None = None) -> Struct:
        """One reply line; `end` holds the last line's reason, durations and counts."""
        end = end or {}
        if self._chat:
            message = MessageOut("assistant", content, thinking or UNSET, calls or UNSET)
            return ChatChunk(model=self._model, created_at=timestamp(), done=bool(end), message=message, **end)
        return GenerateChunk(model=self._model, created_at=timestamp(), done=bool(end), response=content,
                             thinking=thinking or UNSET, **end)

    def openings(self) -> list[Struct]:
        return []

    def step(self, step: Step) -> list[Struct]:
        lines = [line for event in step.events for line in self._lines(event)]
        self._held += _logprobs(step.logprobs)
        if lines and self._held:
            lines[-1].logprobs, self._held = self._held, []
        return lines

    def closing(self, usage: Usage) -> list[Struct]:
        last = self.line(end=self._end(self._finish, usage))
        if self._held:
            last.logprobs = self._held
        return [last]

    def error(self, error: APIError) -> ErrorBody:
        return error_body(error)

    def body(self, collected: Collected) -> Struct:
        outcome = collected.outcomes[0]
        calls = [ToolCall(FunctionCall(c.function.name, arguments_object(c.function.arguments)))
                 for c in outcome.tool_calls]
        whole = self.line(outcome.content or "", outcome.reasoning, calls, self._end(outcome.finish, collected.usage))
        if self._logprobs:
            whole.logprobs = _logprobs(outcome.logprobs)
        return whole

    def _lines(self, event: Event) -> list[Struct]:
        if isinstance(event, (TextDelta, ReasoningDelta)) and event.text:
            self._clock.mark()
            if isinstance(event, TextDelta):
                return self._text(event.text)
            return [self.line(thinking=event.text)]
        if isinstance(event, ToolCallDelta):
            self._clock.mark()
            self._spaces = ""
            return self._call(event)
        if isinstance(event, Finish):
            self._finish = event
            return self._sent_calls() or self._text("", final=True)
        return []

    def _text(self, text: str, final: bool = False) -> list[Struct]:
        """Text goes out once it holds more than spaces: the whole reply drops the spaces a model
        writes before its tool calls."""
        text, self._spaces = self._spaces + text, ""
        if not self._texted and not text.strip() and not final:
            self._spaces = text
            return []
        self._texted = self._texted or bool(text)
        return [self.line(text)] if text else []

    def _call(self, event: ToolCallDelta) -> list[Struct]:
        if event.id is None:
            self._calls[-1][1].append(event.arguments_fragment)
            return []
        sent = self._sent_calls()
        self._calls.append((event.name, [event.arguments_fragment]))
        return sent

    def _sent_calls(self) -> list[Struct]:
        if not self._calls:
            return []
        calls = [ToolCall(FunctionCall(name, arguments_object("".join(parts)))) for name, parts in self._calls]
        self._calls = []
        return [self.line(calls=calls)]

    def _end(self, finish: Finish, usage: Usage) -> dict:
        return dict(done_reason=done_reason(finish), **self._clock.stats(usage))
