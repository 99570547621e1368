"""Response bodies of chat and completions, built from the same choice events."""
import time
from abc import ABC, abstractmethod

from msgspec import UNSET, Struct

from pagedserve.gateway.chat_output import ChatOutputOptions, ChoiceOutput
from pagedserve.gateway.generation import ChoiceEvent
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.gateway.logprobs import (TokenLogprob, chat_logprobs, completion_logprobs, echo_logprobs,
                                         prompt_logprobs)
from pagedserve.gateway.schemas import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                             ChatLogprobs, ChatMessageOut, Completion, CompletionChoice,
                             CompletionLogprobs, Delta, Usage)
from pagedserve.v1 import engine_pb2 as pb

# Each choice's prompt logprobs from the engine (None where it sent none).
PromptEntries = list[list[pb.TokenLogprobs] | None]


class PromptLogprobs:
    """How the choices' prompt logprobs are shown: vLLM's prompt_logprobs, and (completions'
    echo with logprobs) OpenAI's, as the prompt's tokens ahead of the output's."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[list[int]], vllm: bool, echo: bool) -> None:
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.vllm = vllm
        self.echo = echo

    def vllm_form(self, index: int, entries: list[pb.TokenLogprobs] | None):
        return prompt_logprobs(self.tokenizer, self.prompt_ids[index], entries or []) if self.vllm else UNSET

    def echo_tokens(self, index: int, entries: list[pb.TokenLogprobs] | None) -> list[TokenLogprob]:
        if not self.echo or entries is None:
            return []
        return echo_logprobs(self.tokenizer, self.prompt_ids[index], entries)


class ResponseBuilder(ABC):
    """What chat and completions share: one id, creation time and model name on every chunk."""
    id_prefix: str
    chunk_type: type[ChatCompletionChunk] | type[Completion]

    def __init__(self, request_id: str, model: str, num_choices: int, include_usage: bool,
                 logprobs: bool, prompt: PromptLogprobs | None = None) -> None:
        self.id = self.id_prefix + request_id
        self.prompt = prompt
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
                 usage: Usage, prompts: PromptEntries) -> Struct:
        """The non-stream body from each choice's full text, token logprobs, last event and
        prompt logprobs."""


class ChatResponses(ResponseBuilder):
    id_prefix = "chatcmpl-"
    chunk_type = ChatCompletionChunk

    def __init__(self, request_id: str, model: str, num_choices: int, include_usage: bool,
                 logprobs: bool, options: ChatOutputOptions | None = None,
                 prompt: PromptLogprobs | None = None) -> None:
        super().__init__(request_id, model, num_choices, include_usage, logprobs, prompt)
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
                 usage: Usage, prompts: PromptEntries) -> Struct:
        choices = [ChatChoice(f.index, self._message(f.index, texts[f.index]),
                              self._outputs[f.index].finish_reason(f.finish_reason), f.stop_reason,
                              self._logprobs(logprobs[f.index])) for f in finals]
        body = ChatCompletion(self.id, self.created, self.model, choices, usage)
        if self.prompt is not None:
            # One prompt for every choice of a chat.
            body.prompt_logprobs = self.prompt.vllm_form(0, prompts[0])
        return body

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
                 logprobs: bool, echo: list[str], prompt: PromptLogprobs | None = None) -> None:
        super().__init__(request_id, model, num_choices, include_usage, logprobs, prompt)
        # echo[i] is the prompt text that choice i starts with ("" without echo).
        self._echo = echo
        # Where choice i's next streamed token starts in its text, for logprobs' text_offset.
        self._offsets = [len(text) for text in echo]

    def openings(self) -> list[Struct]:
        return [self._chunk([CompletionChoice(i, text)]) for i, text in enumerate(self._echo) if text]

    def chunk(self, event: ChoiceEvent) -> Struct:
        i, logprobs = event.index, None
        if self.logprobs:
            # The prompt's tokens (echo) ride on the choice's first chunk; its text came before.
            prompt = self._prompt_tokens(i, event.prompt_logprobs)
            logprobs, self._offsets[i] = completion_logprobs(event.logprobs, self._offsets[i])
            if prompt:
                logprobs = _joined(completion_logprobs(prompt, 0)[0], logprobs)
        choice = CompletionChoice(i, event.text, event.finish_reason, event.stop_reason, logprobs)
        if self.prompt is not None and event.prompt_logprobs is not None:
            choice.prompt_logprobs = self.prompt.vllm_form(i, event.prompt_logprobs)
        return self._chunk([choice])

    def response(self, texts: list[str], logprobs: list[list[TokenLogprob]], finals: list[ChoiceEvent],
                 usage: Usage, prompts: PromptEntries) -> Struct:
        choices = [CompletionChoice(f.index, self._echo[f.index] + texts[f.index], f.finish_reason,
                                    f.stop_reason, self._logprobs(logprobs[f.index], f.index, prompts[f.index]))
                   for f in finals]
        if self.prompt is not None:
            for c in choices:
                c.prompt_logprobs = self.prompt.vllm_form(c.index, prompts[c.index])
        return Completion(self.id, self.created, self.model, choices, usage)

    def _prompt_tokens(self, index: int, entries: list[pb.TokenLogprobs] | None) -> list[TokenLogprob]:
        return [] if self.prompt is None else self.prompt.echo_tokens(index, entries)

    def _logprobs(self, tokens: list[TokenLogprob], index: int,
                  entries: list[pb.TokenLogprobs] | None) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        prompt = self._prompt_tokens(index, entries)
        if prompt:
            return completion_logprobs(prompt + tokens, 0)[0]
        return completion_logprobs(tokens, len(self._echo[index]))[0]


def _joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(first.tokens + second.tokens, first.token_logprobs + second.token_logprobs,
                              first.top_logprobs + second.top_logprobs, first.text_offset + second.text_offset)
