"""Response bodies of chat and completions, built from the same choice events."""
import time
from abc import ABC, abstractmethod

from msgspec import UNSET, Struct

from pagedserve.gateway.chat_output import ChatOutputOptions, ChoiceOutput
from pagedserve.gateway.generation import ChoiceEvent
from pagedserve.gateway.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from pagedserve.gateway.schemas import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                             ChatLogprobs, ChatMessageOut, Completion, CompletionChoice,
                             CompletionLogprobs, Delta, Usage)


class ResponseBuilder(ABC):
    """What chat and completions share: one id, creation time and model name on every chunk."""
    id_prefix: str
    chunk_type: type[ChatCompletionChunk] | type[Completion]

    def __init__(self, request_id: str, model: str, num_choices: int, include_usage: bool,
                 logprobs: bool) -> None:
        self.id = self.id_prefix + request_id
        self.created = int(time.time())
        self.model = model
        self.num_choices = num_choices
        self.include_usage = include_usage
        # Whether the request asked for logprobs: without, every choice's "logprobs" is null.
        self.logprobs = logprobs
        # include_usage puts "usage": null on every chunk; without it the key is absent.
        self._chunk_usage = None if include_usage else UNSET

    def _chunk(self, choices: list, usage: Usage | None = UNSET) -> Struct:
        return self.chunk_type(self.id, self.created, self.model, choices,
                               self._chunk_usage if usage is UNSET else usage)

    def usage_chunk(self, usage: Usage) -> Struct:
        return self._chunk([], usage)

    @abstractmethod
    def openings(self) -> list[Struct]:
        """Chunks sent before the first generated text."""

    @abstractmethod
    def chunk(self, event: ChoiceEvent) -> Struct:
        """The stream chunk carrying one choice event."""

    @abstractmethod
    def response(self, texts: list[str], logprobs: list[list[TokenLogprob]], finals: list[ChoiceEvent],
                 usage: Usage) -> Struct:
        """The non-stream body from each choice's full text, token logprobs and last event."""


class ChatResponses(ResponseBuilder):
    id_prefix = "chatcmpl-"
    chunk_type = ChatCompletionChunk

    def __init__(self, request_id: str, model: str, num_choices: int, include_usage: bool,
                 logprobs: bool, options: ChatOutputOptions | None = None) -> None:
        super().__init__(request_id, model, num_choices, include_usage, logprobs)
        self._options = options or ChatOutputOptions()
        self._outputs = [ChoiceOutput(self._options) for _ in range(num_choices)]

    def openings(self) -> list[Struct]:
        return [self._chunk([ChatChunkChoice(i, Delta(role="assistant", content=""))])
                for i in range(self.num_choices)]

    def chunk(self, event: ChoiceEvent) -> Struct:
        output = self._outputs[event.index]
        finish_reason = event.finish_reason
        delta = output.delta(event.text, finish_reason is not None)
        if finish_reason is not None:
            finish_reason = output.finish_reason(finish_reason)
        return self._chunk([ChatChunkChoice(event.index, delta, finish_reason, event.stop_reason,
                                            self._logprobs(event.logprobs))])

    def response(self, texts: list[str], logprobs: list[list[TokenLogprob]], finals: list[ChoiceEvent],
                 usage: Usage) -> Struct:
        choices = [ChatChoice(f.index, self._message(f.index, texts[f.index]),
                              self._outputs[f.index].finish_reason(f.finish_reason), f.stop_reason,
                              self._logprobs(logprobs[f.index])) for f in finals]
        return ChatCompletion(self.id, self.created, self.model, choices, usage)

    def _message(self, index: int, text: str) -> ChatMessageOut:
        m = self._outputs[index].message(text)
        out = ChatMessageOut(m.content, tool_calls=m.tool_calls)
        if self._options.reasoning:
            out.reasoning = out.reasoning_content = m.reasoning
        return out

    def _logprobs(self, tokens: list[TokenLogprob]) -> ChatLogprobs | None:
        return chat_logprobs(tokens) if self.logprobs else None


class CompletionResponses(ResponseBuilder):
    id_prefix = "cmpl-"
    chunk_type = Completion

    def __init__(self, request_id: str, model: str, num_choices: int, include_usage: bool,
                 logprobs: bool, echo: list[str]) -> None:
        super().__init__(request_id, model, num_choices, include_usage, logprobs)
        # echo[i] is the prompt text that choice i starts with ("" without echo).
        self._echo = echo
        # Where choice i's next streamed token starts in its text, for logprobs' text_offset.
        self._offsets = [len(text) for text in echo]

    def openings(self) -> list[Struct]:
        return [self._chunk([CompletionChoice(i, text)]) for i, text in enumerate(self._echo) if text]

    def chunk(self, event: ChoiceEvent) -> Struct:
        logprobs = None
        if self.logprobs:
            logprobs, self._offsets[event.index] = completion_logprobs(event.logprobs,
                                                                       self._offsets[event.index])
        return self._chunk([CompletionChoice(event.index, event.text, event.finish_reason,
                                             event.stop_reason, logprobs)])

    def response(self, texts: list[str], logprobs: list[list[TokenLogprob]], finals: list[ChoiceEvent],
                 usage: Usage) -> Struct:
        choices = [CompletionChoice(f.index, self._echo[f.index] + texts[f.index], f.finish_reason,
                                    f.stop_reason, self._logprobs(logprobs[f.index], f.index))
                   for f in finals]
        return Completion(self.id, self.created, self.model, choices, usage)

    def _logprobs(self, tokens: list[TokenLogprob], index: int) -> CompletionLogprobs | None:
        return completion_logprobs(tokens, len(self._echo[index]))[0] if self.logprobs else None
