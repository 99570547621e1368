"""Chat and completions on the wire: their chunks and bodies, written from the output events."""
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from msgspec import UNSET, Struct, UnsetType

from pagedserve.gateway.chat_output import ChatOutputOptions
from pagedserve.gateway.errors import APIError, ErrorBody
from pagedserve.gateway.output_events import Collected, Finish, ReasoningDelta, Step, TextDelta, ToolCallDelta
from pagedserve.gateway.logprobs import TokenLogprob, chat_logprobs, completion_logprobs, prompt_logprobs
from pagedserve.gateway.schemas import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                             ChatLogprobs, ChatMessageOut, Completion, CompletionChoice,
                             CompletionLogprobs, Delta, DeltaFunction, DeltaToolCall, Usage)


@dataclass(slots=True, frozen=True)
class PromptLogprobs:
    """How the choices' prompt logprobs are shown: vLLM's prompt_logprobs, and (completions'
    echo with logprobs) OpenAI's, as the prompt's tokens ahead of the output's."""
    vllm: bool
    echo: bool

    def vllm_form(self, tokens: list[TokenLogprob] | None):
        return prompt_logprobs(tokens) if self.vllm else UNSET

    def echo_tokens(self, tokens: list[TokenLogprob] | None) -> list[TokenLogprob]:
        return (tokens or []) if self.echo else []


@dataclass(slots=True, frozen=True)
class Extensions:
    """vLLM's additions to OpenAI's shapes that a request asked for: prompt logprobs, each choice's
    usage so far by its index on its chunks (continuous_usage_stats), and each choice's prompt ids
    with the output's (return_token_ids)."""
    prompt: PromptLogprobs | None = None
    running_usage: Callable[[int], Usage] | None = None
    prompt_token_ids: list[list[int]] | None = None


class ResponseBuilder(ABC):
    """What chat and completions share: one id, creation time and model name on every chunk."""
    id_prefix: str
    chunk_type: type[ChatCompletionChunk] | type[Completion]

    def __init__(self, request_id: str, model: str, num_choices: int, include_usage: bool,
                 logprobs: bool, extensions: Extensions = Extensions()) -> None:
        self.id = self.id_prefix + request_id
        self.prompt = extensions.prompt
        self.created = int(time.time())
        self.model = model
        self.num_choices = num_choices
        self.include_usage = include_usage
        # Whether the request asked for logprobs: without, every choice's "logprobs" is null.
        self.logprobs = logprobs
        # include_usage puts "usage": null on every chunk; without it the key is absent.
        self._chunk_usage = None if include_usage else UNSET
        self._running_usage = extensions.running_usage
        self.prompt_token_ids = extensions.prompt_token_ids

    def _chunk(self, choices: list, usage: Usage | None = UNSET) -> Struct:
        if usage is UNSET:
            usage = self._running_usage(choices[0].index) if self._running_usage else self._chunk_usage
        return self.chunk_type(self.id, self.created, self.model, choices, usage)

    def _opening_usage(self, index: int) -> Usage | None:
        """The usage on a choice's opening chunk: none generated yet (vLLM's, with continuous usage)."""
        if self._running_usage is None:
            return self._chunk_usage
        prompt = self._running_usage(index).prompt_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt)

    def _ids(self, ids: list[int]) -> list[int] | UnsetType:
        return UNSET if self.prompt_token_ids is None else ids

    def _prompt_ids(self, index: int) -> list[int] | UnsetType:
        return UNSET if self.prompt_token_ids is None else self.prompt_token_ids[index]

    def closing(self, usage: Usage) -> list[Struct]:
        """Chunks sent after every choice has finished: the usage, when asked for."""
        return [self._chunk([], usage)] if self.include_usage else []

    def error(self, error: APIError) -> Struct:
        """The event a stream ends with when it fails."""
        return ErrorBody(error=error.info)

    @abstractmethod
    def openings(self) -> list[Struct]:
        """Chunks sent before the first generated text."""

    @abstractmethod
    def step(self, step: Step) -> list[Struct]:
        """The stream chunks carrying one step of one choice."""

    @abstractmethod
    def body(self, collected: Collected) -> Struct:
        """The non-stream body."""


class ChatResponses(ResponseBuilder):
    id_prefix = "chatcmpl-"
    chunk_type = ChatCompletionChunk

    def __init__(self, request_id: str, model: str, num_choices: int, include_usage: bool,
                 logprobs: bool, options: ChatOutputOptions | None = None,
                 extensions: Extensions = Extensions(), echo: str = "", role: str = "assistant") -> None:
        super().__init__(request_id, model, num_choices, include_usage, logprobs, extensions)
        self._options = options or ChatOutputOptions()
        # The text every choice's reply starts with (vLLM's echo; "" without).
        self._echo = echo
        self._role = role

    def openings(self) -> list[Struct]:
        chunks = [self._chunk([ChatChunkChoice(i, Delta(role=self._role, content=""))], self._opening_usage(i))
                  for i in range(self.num_choices)]
        for i, chunk in enumerate(chunks):
            chunk.prompt_token_ids = self._prompt_ids(i)
        if self._echo:
            chunks += [self._chunk([ChatChunkChoice(i, Delta(content=self._echo))], self._opening_usage(i))
                       for i in range(self.num_choices)]
        return chunks

    def step(self, step: Step) -> list[Struct]:
        if not self._options.reasoning and step.events and all(isinstance(e, ReasoningDelta) for e in step.events):
            # Thinking the request left out (include_reasoning false): no chunk to carry.
            return []
        delta, calls = Delta(), []
        for event in step.events:
            match event:
                case ReasoningDelta(text=text) if self._options.reasoning:
                    delta.reasoning = delta.reasoning_content = text
                case TextDelta(text=text):
                    delta.content = text
                case ToolCallDelta():
                    calls.append(_delta_call(event))
        delta.tool_calls = calls or None
        return [self._chunk([ChatChunkChoice(step.choice, delta, *_ending(step), self._logprobs(step.logprobs),
                                             self._ids(step.token_ids))])]

    def body(self, collected: Collected) -> Struct:
        choices = [ChatChoice(o.choice, self._message(o.content, o.tool_calls, o.reasoning), o.finish.reason,
                              o.finish.stop_reason, self._logprobs(o.logprobs), self._ids(o.token_ids))
                   for o in collected.outcomes]
        body = ChatCompletion(self.id, self.created, self.model, choices, collected.usage)
        body.prompt_token_ids = self._prompt_ids(0)
        if self.prompt is not None:
            # One prompt for every choice of a chat.
            body.prompt_logprobs = self.prompt.vllm_form(collected.outcomes[0].prompt_logprobs)
        return body

    def _message(self, content: str | None, tool_calls: list, reasoning: str | None) -> ChatMessageOut:
        out = ChatMessageOut(self._echo + (content or "") if self._echo else content, self._role,
                             tool_calls=tool_calls)
        if self._options.reasoning:
            out.reasoning = out.reasoning_content = reasoning
        return out

    def _logprobs(self, tokens: list[TokenLogprob]) -> ChatLogprobs | None:
        return chat_logprobs(tokens) if self.logprobs else None


class CompletionResponses(ResponseBuilder):
    id_prefix = "cmpl-"
    chunk_type = Completion

    def __init__(self, request_id: str, model: str, num_choices: int, include_usage: bool,
                 logprobs: bool, echo: list[str], extensions: Extensions = Extensions()) -> None:
        super().__init__(request_id, model, num_choices, include_usage, logprobs, extensions)
        # echo[i] is the prompt text that choice i starts with ("" without echo).
        self._echo = echo
        # Where choice i's next streamed token starts in its text, for logprobs' text_offset.
        self._offsets = [len(text) for text in echo]
        # The choices whose prompt ids have gone out (return_token_ids: on each one's first chunk).
        self._ids_sent: set[int] = set()

    def openings(self) -> list[Struct]:
        return [self._chunk([CompletionChoice(i, text)], self._opening_usage(i)) for i, text in enumerate(self._echo)
                if text]

    def step(self, step: Step) -> list[Struct]:
        i, logprobs = step.choice, None
        if self.logprobs:
            # The prompt's tokens (echo) ride on the choice's first chunk; its text came before.
            prompt = self._prompt_tokens(step.prompt_logprobs)
            logprobs, self._offsets[i] = completion_logprobs(step.logprobs, self._offsets[i])
            if prompt:
                logprobs = _joined(completion_logprobs(prompt, 0)[0], logprobs)
        text = "".join(e.text for e in step.events if isinstance(e, TextDelta))
        choice = CompletionChoice(i, text, *_ending(step), logprobs=logprobs, token_ids=self._ids(step.token_ids))
        if self.prompt is not None and step.prompt_logprobs is not None:
            choice.prompt_logprobs = self.prompt.vllm_form(step.prompt_logprobs)
        if i not in self._ids_sent:
            self._ids_sent.add(i)
            choice.prompt_token_ids = self._prompt_ids(i)
        return [self._chunk([choice])]

    def body(self, collected: Collected) -> Struct:
        choices = [CompletionChoice(o.choice, self._echo[o.choice] + o.text, o.finish.reason, o.finish.stop_reason,
                                    self._logprobs(o.logprobs, o.choice, o.prompt_logprobs),
                                    prompt_token_ids=self._prompt_ids(o.choice), token_ids=self._ids(o.token_ids))
                   for o in collected.outcomes]
        if self.prompt is not None:
            for c, o in zip(choices, collected.outcomes):
                c.prompt_logprobs = self.prompt.vllm_form(o.prompt_logprobs)
        return Completion(self.id, self.created, self.model, choices, collected.usage)

    def _prompt_tokens(self, prompt: list[TokenLogprob] | None) -> list[TokenLogprob]:
        return [] if self.prompt is None else self.prompt.echo_tokens(prompt)

    def _logprobs(self, tokens: list[TokenLogprob], index: int,
                  prompt_tokens: list[TokenLogprob] | None) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        prompt = self._prompt_tokens(prompt_tokens)
        if prompt:
            return completion_logprobs(prompt + tokens, 0)[0]
        return completion_logprobs(tokens, len(self._echo[index]))[0]


def _ending(step: Step) -> tuple[str | None, str | int | None]:
    """The finish_reason and stop_reason a step's chunk carries (None, None before the last)."""
    finish = step.events[-1] if step.events else None
    return (finish.reason, finish.stop_reason) if isinstance(finish, Finish) else (None, None)


def _delta_call(event: ToolCallDelta) -> DeltaToolCall:
    """A call's first fragment carries its id, type and name; later ones its arguments only."""
    if event.id is None:
        return DeltaToolCall(event.index, DeltaFunction(arguments=event.arguments_fragment))
    return DeltaToolCall(event.index, DeltaFunction(event.name, event.arguments_fragment), event.id, "function")


def _joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(first.tokens + second.tokens, first.token_logprobs + second.token_logprobs,
                              first.top_logprobs + second.top_logprobs, first.text_offset + second.text_offset)
