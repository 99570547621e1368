"""One request's choices: an engine request per choice, merged into a single stream of text events."""
import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from itertools import accumulate, groupby
from operator import itemgetter

from msgspec import UNSET

from pagedserve.common.detokenizer import IncrementalDetokenizer
from pagedserve.gateway.engine_client import Routing, SchedulerDown
from pagedserve.gateway.engine_pool import Engine, EnginePool
from pagedserve.gateway.errors import APIError
from pagedserve.gateway.logprobs import TokenLogprob, decode_logprobs, decode_prompt
from pagedserve.gateway.metrics import ChoiceStats, ModelMetrics
from pagedserve.gateway.schemas import PromptTokensDetails, Usage
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.common.sampling_params import SamplingParams, choice_params, sampling_to_proto
from pagedserve.v1 import engine_pb2 as pb
from pagedserve.v1 import sampling_pb2

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(slots=True)
class ChoiceEvent:
    """New text of one choice; finish_reason is set on its last event only. With logprobs asked,
    those of the tokens received since the previous event (text held back moves them later)."""
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # With prompt_logprobs, on the choice's first event: every prompt token (the first without a logprob).
    prompt_logprobs: list[TokenLogprob] | None = None
    # The tokens received since the previous event.
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Progress:
    """What a choice has received and not yet sent as an event."""
    detok: IncrementalDetokenizer
    stats: ChoiceStats
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_tokens: int = 0
    sent: bool = False
    prompt: list[TokenLogprob] | None = None
    token_ids: list[int] = field(default_factory=list)

    def event(self, index: int) -> ChoiceEvent:
        event = ChoiceEvent(index, self.text, logprobs=self.logprobs, prompt_logprobs=self.prompt,
                            token_ids=self.token_ids)
        self.text, self.logprobs, self.pending_tokens, self.sent, self.prompt = "", [], 0, True, None
        self.token_ids = []
        return event


@dataclass(slots=True)
class Choice:
    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # `params` as the scheduler receives them.
    wire: sampling_pb2.SamplingParams
    counts_prompt: bool
    routing: Routing = Routing()
    # The scheduler it runs on, picked when the generation starts.
    engine: Engine | None = None
    # The scheduler's counts, which usage and the metrics report as they are, never recounted here:
    # it holds the tokens the model computed, and one message then carries all three counts
    # (0 until the choice's first response, as the metrics count no prompt before one).
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    # Set when its engine request starts.
    progress: _Progress | None = None
    # Whether its engine request has ended (finished, failed or stopped here).
    ended: bool = False


def fan_out(request_id: str, prompts: list[list[int]], params: SamplingParams,
            routing: Routing = Routing()) -> list[Choice]:
    """n choices per prompt, each its own engine request; seeds differ so that samples do too. The
    parameters are converted to their wire form once per request: each choice gets a copy (made
    in C) that differs in its seed only."""
    children = choice_params(params)
    wire = sampling_to_proto(params)
    wires = [_seeded(wire, child.seed) for child in children]
    choices = []
    for p, prompt in enumerate(prompts):
        for i, child in enumerate(children):
            index = p * params.n + i
            choices.append(Choice(index, f"{request_id}-{index}", prompt, child, wires[i], counts_prompt=i == 0,
                                  routing=routing))
    return choices


def _seeded(wire: sampling_pb2.SamplingParams, seed: int | None) -> sampling_pb2.SamplingParams:
    if seed is None:
        return wire
    copied = sampling_pb2.SamplingParams()
    copied.CopyFrom(wire)
    copied.seed = seed
    return copied


@dataclass(slots=True, frozen=True)
class RequestLog:
    """The request log: a line per finished request at info (--enable-log-requests; else debug),
    holding its outputs with --enable-log-outputs, each cut to `max_len` characters (--max-log-len;
    None: whole, as vLLM logs them)."""
    enabled: bool = False
    outputs: bool = False
    max_len: int | None = None


class Generation:
    """Runs the choices of one request concurrently; events() yields their text as it is produced.

    The replies of every choice land on one queue that events() reads, so a token costs one task
    switch between the scheduler's stream and the client's."""

    def __init__(self, engines: EnginePool, tokenizer: Tokenizer, choices: list[Choice],
                 trace_id: str, metrics: ModelMetrics, arrival: float, stream_interval: int = 1,
                 log: RequestLog = RequestLog(), prompt_tokens_details: bool = False,
                 tokens_as_ids: bool = False) -> None:
        self._engines = engines
        self._trace_id = trace_id
        self._tokenizer = tokenizer
        self.choices = choices
        self.metrics = metrics
        # time.monotonic() when the request was accepted (validated, tokenized): vLLM's arrival time,
        # from which the latency metrics count.
        self._arrival = arrival
        self._stream_interval = stream_interval
        # How its end is logged.
        self.log = log
        # Whether usage reports cached_tokens (--enable-prompt-tokens-details).
        self._prompt_tokens_details = prompt_tokens_details
        # Whether logprobs name tokens "token_id:N" (return_tokens_as_token_ids).
        self._tokens_as_ids = tokens_as_ids
        self._queue: asyncio.Queue[tuple[Choice, pb.GenerateResponse | APIError] | Exception] = asyncio.Queue()

    def like(self, choices: list[Choice]) -> "Generation":
        """A generation of other choices for the same request (a beam search's rounds), unlogged."""
        return Generation(self._engines, self._tokenizer, choices, self._trace_id, self.metrics, self._arrival,
                          self._stream_interval, RequestLog(), self._prompt_tokens_details, self._tokens_as_ids)

    def usage(self) -> Usage:
        # The n choices of one prompt share it: its tokens count once, as OpenAI counts them.
        firsts = [c for c in self.choices if c.counts_prompt]
        prompt = sum(c.prompt_tokens for c in firsts)
        completion = sum(c.completion_tokens for c in self.choices)
        details = PromptTokensDetails(sum(c.cached_tokens for c in firsts)) if self._prompt_tokens_details else UNSET
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details)

    def choice_usage(self, index: int) -> Usage:
        """One choice's usage so far (vLLM's continuous_usage_stats): its prompt as tokenized here,
        which a choice's chunks need before its first response carries the scheduler's count, and
        the tokens it has generated."""
        choice = self.choices[index]
        prompt = len(choice.prompt_token_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=choice.completion_tokens,
                     total_tokens=prompt + choice.completion_tokens)

    def interrupt(self, error: Exception) -> None:
        """Makes events() raise `error` after the events already produced (a shutdown)."""
        self._queue.put_nowait(error)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Merged events of all choices; closing it aborts every engine request still running."""
        self._pick_engines()
        for choice in self.choices:
            self._start(choice)
        running = len(self.choices)
        try:
            while running:
                item = await self._queue.get()
                if isinstance(item, Exception):
                    raise item
                choice, reply = item
                if choice.ended:
                    continue
                event = self._receive(choice, reply)
                if event is None:
                    continue
                if event.finish_reason is not None:
                    running -= 1
                    self._end(choice, event.finish_reason)
                yield event
        finally:
            for choice in self.choices:
                if not choice.ended:
                    self._end(choice, None)

    def _pick_engines(self) -> None:
        # A prompt's n choices share it, so they go to one scheduler, whose prefix cache then holds it.
        prompt_numbers = accumulate(int(c.counts_prompt) for c in self.choices)
        for _, group in groupby(zip(prompt_numbers, self.choices), key=itemgetter(0)):
            same_prompt = [c for _, c in group]
            engine = self._engines.pick(same_prompt[0].prompt_token_ids, len(same_prompt))
            for choice in same_prompt:
                choice.engine = engine

    def _start(self, choice: Choice) -> None:
        p = choice.params
        detok = IncrementalDetokenizer(self._tokenizer, p.skip_special_tokens, p.stop,
                                       p.include_stop_str_in_output, choice.prompt_token_ids)
        choice.progress = _Progress(detok, ChoiceStats(self.metrics, self._arrival, choice.routing.background))
        queue = self._queue
        choice.engine.client.start(choice.request_id, choice.prompt_token_ids, choice.wire, self._trace_id,
                                   lambda reply: queue.put_nowait((choice, reply)), choice.routing)

    def _end(self, choice: Choice, finish_reason: str | None) -> None:
        # Ending a request the scheduler has not finished (a stop string, a client gone) aborts it.
        choice.ended = True
        choice.finish_reason = finish_reason
        choice.engine.client.stop(choice.request_id)
        self._engines.ended(choice.engine)
        prompt_tokens = choice.prompt_tokens if choice.counts_prompt else 0
        choice.progress.stats.end(finish_reason, prompt_tokens, choice.completion_tokens)

    def _receive(self, choice: Choice, reply: pb.GenerateResponse | APIError) -> ChoiceEvent | None:
        """The event a reply makes, if any: the choice's last when it carries a finish. Raises the
        APIError of a failed request, taking a scheduler that is down out of rotation."""
        try:
            if isinstance(reply, APIError):
                raise reply
            return self._event(choice, reply)
        except APIError as e:
            self._engines.failed(choice.engine, e)
            raise

    def _event(self, choice: Choice, response: pb.GenerateResponse) -> ChoiceEvent | None:
        progress = choice.progress
        progress.stats.response()
        choice.prompt_tokens = response.prompt_tokens
        choice.completion_tokens = response.completion_tokens
        choice.cached_tokens = max(choice.cached_tokens, response.cached_tokens)
        if response.logprobs:
            progress.logprobs += decode_logprobs(self._tokenizer, response.token_ids, response.logprobs,
                                                 self._tokens_as_ids)
        if response.prompt_logprobs:
            progress.prompt = decode_prompt(self._tokenizer, choice.prompt_token_ids, response.prompt_logprobs,
                                            self._tokens_as_ids)
        detok = progress.detok
        progress.text += detok.add(response.token_ids, response.HasField("stop_token_id"))
        progress.pending_tokens += len(response.token_ids)
        progress.token_ids += response.token_ids
        if detok.stopped:
            event = progress.event(choice.index)
            event.finish_reason, event.stop_reason = "stop", detok.stop_reason
            return event
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            progress.text += detok.flush()
            event = progress.event(choice.index)
            event.finish_reason, event.stop_reason = self._finish(choice, response)
            return event
        # The first text goes out at once: the interval must not delay the time to first token.
        if progress.text and (progress.pending_tokens >= self._stream_interval or not progress.sent):
            return progress.event(choice.index)
        return None

    def _finish(self, choice: Choice, response: pb.GenerateResponse) -> tuple[str, int | None]:
        """The finish_reason and stop_reason of a response that ends its request."""
        reason = _FINISH.get(response.finish_reason)
        if reason is None:
            raise SchedulerDown("The scheduler aborted the request (it may be shutting down); retry.")
        stop_token = response.stop_token_id if response.HasField("stop_token_id") else None
        # vLLM's convention: stop_reason names a matched stop_token_ids entry, and is null for EOS.
        stop_reason = stop_token if stop_token in choice.params.stop_token_ids else None
        return reason, stop_reason
