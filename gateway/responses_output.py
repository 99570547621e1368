"""The Responses API's side of the output events: the response object and its output items
(reasoning, message, function_call), and the stream of events the openai SDK's stream helper reads,
numbered by sequence_number. A message item appears only once its text holds more than spaces, in
a stream and a body alike, so the two hold the same items.

With `include: ["message.output_text.logprobs"]` a message's output_text holds the logprobs of every
output token, as vLLM's body does (reasoning tokens too). A stream's text deltas each carry the
tokens that came since the previous one, and the message's done events all of them so far; tokens
after a message has closed (a tool call's) are in the body's list only."""
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from msgspec import Struct

from pagedserve.gateway.errors import APIError
from pagedserve.gateway.logprobs import TokenLogprob, chat_logprobs
from pagedserve.gateway.output_events import (Collected, Finish, Outcome, ReasoningDelta, Step, TextDelta,
                                              ToolCallDelta)
from pagedserve.gateway.responses_schemas import (ArgumentsDelta, ArgumentsDone, ContentPartAdded, ContentPartDone,
                                                  ErrorEvent, FunctionCall, IncompleteDetails, InputTokensDetails,
                                                  OutputItem, OutputItemAdded, OutputItemDone, OutputMessage,
                                                  OutputText, OutputTextDelta, OutputTextDone, Reasoning,
                                                  ReasoningText, ReasoningTextDelta, ReasoningTextDone, Response,
                                                  ResponseCompleted, ResponseCreated, ResponseIncomplete,
                                                  ResponseInProgress, ResponseUsage, StreamEvent)
from pagedserve.gateway.schemas import ChatTokenLogprob, Usage


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: Usage) -> ResponseUsage:
    details = usage.prompt_tokens_details
    cached = getattr(details, "cached_tokens", 0)
    return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens, input_tokens_details=InputTokensDetails(cached))


def _has_text(text: str | None) -> bool:
    return bool(text and text.strip())


def outcome_items(outcome: Outcome, logprobs: bool = False) -> list[OutputItem]:
    """The output items of a choice's whole output: its reasoning, its message (with every output
    token's logprobs, if asked for), its calls."""
    items: list[OutputItem] = []
    if outcome.reasoning:
        items.append(Reasoning(id=new_id("rs"), status="completed", content=[ReasoningText(text=outcome.reasoning)]))
    if _has_text(outcome.content):
        text = OutputText(text=outcome.content, logprobs=_logprobs(outcome.logprobs) if logprobs else [])
        items.append(OutputMessage(id=new_id("msg"), status="completed", content=[text]))
    items += [FunctionCall(id=new_id("fc"), call_id=call.id, name=call.function.name,
                           arguments=call.function.arguments, status="completed") for call in outcome.tool_calls]
    if items:
        # As in a stream, where the finish ends the last item only.
        items[-1].status = _item_status(outcome.finish)
    return items


def _logprobs(tokens: list[TokenLogprob]) -> list[ChatTokenLogprob]:
    return chat_logprobs(tokens).content


def _item_status(finish: Finish) -> str:
    return "incomplete" if finish.reason == "length" else "completed"


@dataclass(slots=True)
class _OpenItem:
    """The output item a stream is writing: its kind, id, place, and what it holds so far."""
    kind: str
    id: str
    output_index: int
    parts: list[str] = field(default_factory=list)
    name: str = ""
    call_id: str = ""
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)


class ResponsesOutput:
    """The Wire of /v1/responses (see serving.run): `response` is the object being built, shown
    in progress when the stream opens; `finished` receives it once complete (to store it)."""

    def __init__(self, response: Response, finished: Callable[[Response], None], logprobs: bool = False) -> None:
        self.id = response.id
        self._logprobs = logprobs
        # Output tokens not yet carried by a text delta.
        self._pending: list[TokenLogprob] = []
        self.response = response
        self.finished = finished
        self._sequence = 0
        self._items: list[OutputItem] = []
        self._open: _OpenItem | None = None
        # Spaces that would open a message item, held until text follows them.
        self._spaces = ""
        self._finish = Finish("stop")

    def _event(self, kind: type[StreamEvent], **fields) -> StreamEvent:
        event = kind(sequence_number=self._sequence, **fields)
        self._sequence += 1
        return event

    def openings(self) -> list[Struct]:
        return [self._event(ResponseCreated, response=self.response),
                self._event(ResponseInProgress, response=self.response)]

    def step(self, step: Step) -> list[Struct]:
        out: list[Struct] = []
        if self._logprobs:
            self._pending += step.logprobs
        for event in step.events:
            match event:
                case ReasoningDelta(text=text):
                    out += self._reasoning(text)
                case TextDelta(text=text):
                    out += self._text(text)
                case ToolCallDelta():
                    out += self._call(event)
                case Finish():
                    self._finish = event
                    out += self._close()
        return out

    def closing(self, usage: Usage) -> list[Struct]:
        self._complete(self._items, usage)
        kind = ResponseIncomplete if self.response.status == "incomplete" else ResponseCompleted
        return [self._event(kind, response=self.response)]

    def error(self, error: APIError) -> Struct:
        return self._event(ErrorEvent, message=error.info.message, code=error.info.code or error.info.type,
                           param=error.info.param)

    def body(self, collected: Collected) -> Struct:
        outcome = collected.outcomes[0]
        self._finish = outcome.finish
        self._complete(outcome_items(outcome, self._logprobs), collected.usage)
        return self.response

    def _complete(self, items: list[OutputItem], usage: Usage) -> None:
        response = self.response
        response.output = items
        response.usage = response_usage(usage)
        if self._finish.reason == "length":
            response.status, response.incomplete_details = "incomplete", IncompleteDetails("max_output_tokens")
        else:
            response.status, response.completed_at = "completed", int(time.time())
        self.finished(response)

    def _start(self, kind: str, added: OutputItem) -> list[Struct]:
        out = self._close()
        self._open = _OpenItem(kind, added.id, len(self._items))
        out.append(self._event(OutputItemAdded, output_index=self._open.output_index, item=added))
        return out

    def _reasoning(self, text: str) -> list[Struct]:
        out = []
        if self._open is None or self._open.kind != "reasoning":
            out += self._start("reasoning", Reasoning(id=new_id("rs"), status="in_progress", content=[]))
        item = self._open
        item.parts.append(text)
        out.append(self._event(ReasoningTextDelta, item_id=item.id, output_index=item.output_index, content_index=0,
                               delta=text))
        return out

    def _text(self, text: str) -> list[Struct]:
        out = []
        if self._open is None or self._open.kind != "message":
            if not _has_text(text):
                self._spaces += text
                return []
            text, self._spaces = self._spaces + text, ""
            out += self._start("message", OutputMessage(id=new_id("msg"), status="in_progress", content=[]))
            out.append(self._event(ContentPartAdded, item_id=self._open.id, output_index=self._open.output_index,
                                   content_index=0, part=OutputText(text="")))
        item = self._open
        item.parts.append(text)
        out.append(self._event(OutputTextDelta, item_id=item.id, output_index=item.output_index, content_index=0,
                               delta=text, logprobs=self._take_logprobs(item)))
        return out

    def _take_logprobs(self, item: _OpenItem) -> list[ChatTokenLogprob]:
        """The pending tokens' logprobs, now the message's."""
        taken, self._pending = _logprobs(self._pending), []
        item.logprobs += taken
        return taken

    def _call(self, event: ToolCallDelta) -> list[Struct]:
        out = []
        if event.id is not None:
            added = FunctionCall(id=new_id("fc"), call_id=event.id, name=event.name, arguments="", status="in_progress")
            out += self._start("function_call", added)
            self._open.name, self._open.call_id = event.name, event.id
        item = self._open
        if event.arguments_fragment:
            item.parts.append(event.arguments_fragment)
            out.append(self._event(ArgumentsDelta, item_id=item.id, output_index=item.output_index,
                                   delta=event.arguments_fragment))
        return out

    def _close(self) -> list[Struct]:
        """The events that end the open item, if any; the item joins the output."""
        item, self._open = self._open, None
        self._spaces = ""
        if item is None:
            return []
        text, status, at = "".join(item.parts), _item_status(self._finish), item.output_index
        if item.kind == "reasoning":
            done = Reasoning(id=item.id, status=status, content=[ReasoningText(text=text)])
            out = [self._event(ReasoningTextDone, item_id=item.id, output_index=at, content_index=0, text=text)]
        elif item.kind == "message":
            self._take_logprobs(item)
            part = OutputText(text=text, logprobs=item.logprobs)
            done = OutputMessage(id=item.id, status=status, content=[part])
            out = [self._event(OutputTextDone, item_id=item.id, output_index=at, content_index=0, text=text,
                               logprobs=item.logprobs),
                   self._event(ContentPartDone, item_id=item.id, output_index=at, content_index=0, part=part)]
        else:
            done = FunctionCall(id=item.id, call_id=item.call_id, name=item.name, arguments=text, status=status)
            out = [self._event(ArgumentsDone, item_id=item.id, output_index=at, name=item.name, arguments=text)]
        self._items.append(done)
        out.append(self._event(OutputItemDone, output_index=at, item=done))
        return out
