"""One request's choices: a gRPC Generate call per choice, merged into a single stream of text events."""
import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from itertools import accumulate, groupby
from operator import itemgetter

from pagedserve.common.detokenizer import IncrementalDetokenizer
from pagedserve.gateway.engine_client import SchedulerDown
from pagedserve.gateway.engine_pool import Engine, EnginePool
from pagedserve.gateway.errors import APIError, internal
from pagedserve.gateway.logprobs import TokenLogprob, decode_logprobs
from pagedserve.gateway.metrics import ChoiceStats, ModelMetrics
from pagedserve.gateway.schemas import PromptTokensDetails, Usage
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.common.sampling_params import SamplingParams, choice_params
from pagedserve.v1 import engine_pb2 as pb

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
    # With prompt_logprobs, on the choice's first event: one per prompt token after the first.
    prompt_logprobs: list[pb.TokenLogprobs] | None = None


@dataclass(slots=True)
class Choice:
    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    counts_prompt: bool
    # The scheduler it runs on, picked when the generation starts.
    engine: Engine | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None


def fan_out(request_id: str, prompts: list[list[int]], params: SamplingParams) -> list[Choice]:
    """n choices per prompt, each its own engine request; seeds differ so that samples do too."""
    choices = []
    for p, prompt in enumerate(prompts):
        for i, child in enumerate(choice_params(params)):
            index = p * params.n + i
            choices.append(Choice(index, f"{request_id}-{index}", prompt, child, counts_prompt=i == 0))
    return choices


class Generation:
    """Runs the choices of one request concurrently; events() yields their text as it is produced."""

    def __init__(self, engines: EnginePool, tokenizer: Tokenizer, choices: list[Choice],
                 trace_id: str, metrics: ModelMetrics, arrival: float, stream_interval: int = 1,
                 log_requests: bool = False) -> None:
        self._engines = engines
        self._trace_id = trace_id
        self._tokenizer = tokenizer
        self.choices = choices
        self.metrics = metrics
        # time.monotonic() when the request was accepted (validated, tokenized): vLLM's arrival time,
        # from which the latency metrics count.
        self._arrival = arrival
        self._stream_interval = stream_interval
        # Whether its end is logged at info with its parameters (--enable-log-requests).
        self.log_requests = log_requests
        self._queue: asyncio.Queue[ChoiceEvent | Exception] = asyncio.Queue()

    def usage(self) -> Usage:
        # The n choices of one prompt share it: its tokens count once, as OpenAI counts them.
        firsts = [c for c in self.choices if c.counts_prompt]
        prompt = sum(len(c.prompt_token_ids) for c in firsts)
        completion = sum(c.completion_tokens for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(sum(c.cached_tokens for c in firsts)))

    def interrupt(self, error: Exception) -> None:
        """Makes events() raise `error` after the events already produced (a shutdown)."""
        self._queue.put_nowait(error)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Merged events of all choices; closing it cancels every engine call still running."""
        queue = self._queue
        self._pick_engines()
        tasks = [asyncio.create_task(self._run(c, queue)) for c in self.choices]
        running = len(tasks)
        try:
            while running:
                event = await queue.get()
                if isinstance(event, Exception):
                    raise event
                running -= event.finish_reason is not None
                yield event
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _pick_engines(self) -> None:
        # A prompt's n choices share it, so they go to one scheduler, whose prefix cache then holds it.
        prompt_numbers = accumulate(int(c.counts_prompt) for c in self.choices)
        for _, group in groupby(zip(prompt_numbers, self.choices), key=itemgetter(0)):
            same_prompt = [c for _, c in group]
            engine = self._engines.pick(same_prompt[0].prompt_token_ids, len(same_prompt))
            for choice in same_prompt:
                choice.engine = engine

    async def _run(self, choice: Choice, queue: asyncio.Queue) -> None:
        stats = ChoiceStats(self.metrics, self._arrival)
        finish_reason = None
        try:
            event = await self._stream(choice, queue, stats)
            finish_reason = choice.finish_reason = event.finish_reason
            queue.put_nowait(event)
        except APIError as e:
            self._engines.failed(choice.engine, e)
            queue.put_nowait(e)
        except Exception as e:
            queue.put_nowait(e)
        finally:
            self._engines.ended(choice.engine)
            prompt_tokens = len(choice.prompt_token_ids) if choice.counts_prompt else 0
            stats.end(finish_reason, prompt_tokens, choice.completion_tokens)

    async def _stream(self, choice: Choice, queue: asyncio.Queue, stats: ChoiceStats) -> ChoiceEvent:
        p = choice.params
        detok = IncrementalDetokenizer(self._tokenizer, p.skip_special_tokens, p.stop,
                                       p.include_stop_str_in_output, choice.prompt_token_ids)
        logprobs: list[TokenLogprob] = []
        text, pending_tokens, sent, prompt = "", 0, False, None
        async with aclosing(choice.engine.client.generate(choice.request_id, choice.prompt_token_ids, p,
                                                   self._trace_id)) as stream:
            async for response in stream:
                stats.response()
                choice.completion_tokens += len(response.token_ids)
                choice.cached_tokens = max(choice.cached_tokens, response.cached_tokens)
                if response.logprobs:
                    logprobs += decode_logprobs(self._tokenizer, response.token_ids, response.logprobs)
                if response.prompt_logprobs:
                    prompt = list(response.prompt_logprobs)
                text += detok.add(response.token_ids)
                pending_tokens += len(response.token_ids)
                if detok.stopped:
                    # Leaving the block cancels the call, which the scheduler turns into an abort.
                    return ChoiceEvent(choice.index, text, "stop", detok.stop_reason, logprobs, prompt)
                if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    event = self._finish(choice, response, text + detok.flush(), logprobs)
                    event.prompt_logprobs = prompt
                    return event
                # The first text goes out at once: the interval must not delay the time to first token.
                if text and (pending_tokens >= self._stream_interval or not sent):
                    queue.put_nowait(ChoiceEvent(choice.index, text, logprobs=logprobs, prompt_logprobs=prompt))
                    text, logprobs, pending_tokens, sent, prompt = "", [], 0, True, None
        raise internal("The scheduler ended a generation without a finish reason.")

    def _finish(self, choice: Choice, response: pb.GenerateResponse, text: str,
                logprobs: list[TokenLogprob]) -> ChoiceEvent:
        reason = _FINISH.get(response.finish_reason)
        if reason is None:
            raise SchedulerDown("The scheduler aborted the request (it may be shutting down); retry.")
        stop_token = response.stop_token_id if response.HasField("stop_token_id") else None
        # vLLM's convention: stop_reason names a matched stop_token_ids entry, and is null for EOS.
        stop_reason = stop_token if stop_token in choice.params.stop_token_ids else None
        return ChoiceEvent(choice.index, text, reason, stop_reason, logprobs)
