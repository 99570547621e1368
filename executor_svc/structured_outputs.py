"""The grammar state of the running requests that have a structured output, and the token bitmask
of the rows that sample.

It lives in the executor, not beside the scheduler as in vLLM: the executor has each sampled token
on the host as soon as the device does, so a matcher advances without a round trip, and the
bitmask (6 KB per row for a 49k vocabulary, 16 KB for 128k) is filled where it is applied instead
of crossing gRPC in every plan. Only the constraint's text travels, once, in SamplingParams. With
two steps in flight the runner settles the step in flight before filling the mask (as for
penalties), after launching the forward, so the fill overlaps the device's work.

A reasoning model's constraint waits for the end of its thinking: the matcher neither masks nor
advances until the request's outputs end with the constraint's reasoning_end_ids (detected by
token id, as vLLM does, which suits models whose </think> is one token).

A grammar still compiling when its row samples never holds the step (the other rows' tokens): the
row is deferred, its token void and its position computed again the next step, until the grammar
is ready or GRAMMAR_TIMEOUT_S passes, which fails that request alone, as a grammar that cannot
compile does. With tensor parallelism every rank must take the same rows, so the step waits for
the grammar instead (up to the same timeout)."""
import time
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from pagedserve.common.grammar import GrammarCompiler, Matcher
from pagedserve.common.plan import FAILED_PRECONDITION, INVALID_ARGUMENT, NewRequest, RequestError
from pagedserve.common.tokenizer import Tokenizer

# llguidance compiles lazily (about a millisecond for a new schema, 1 MB/s for a regex), and a
# 128k-token tokenizer loads in about a second: a grammar this slow is refused.
GRAMMAR_TIMEOUT_S = 30.0


class StructuredOutputs:
    """Matchers by seq_id; compiling starts when a request arrives, so it overlaps its prefill."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: list[int],
                 max_seqs: int, *, defer: bool) -> None:
        self._model_path = model_path
        self._defer = defer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self.matchers: dict[int, Matcher | Future] = {}
        # Tokens that reached a matcher still compiling (outputs sampled before a preemption, or
        # after a reasoning model's thinking), fed to it once it is ready.
        self._replay: dict[int, list[int]] = {}
        # Requests still thinking: the end token ids, and the latest outputs to compare with them.
        self._thinking: dict[int, tuple[list[int], list[int]]] = {}
        self.bitmask = np.zeros((max_seqs, -(-vocab_size // 32)), dtype=np.int32)
        # When each compile started, for the timeout.
        self._started: dict[int, float] = {}
        # Requests failed since the runner last took them, and the rows the last fill deferred.
        self._errors: dict[int, RequestError] = {}
        self._deferred: list[int] = []

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def add(self, request: NewRequest) -> None:
        params = request.sampling.structured_outputs
        if params is None:
            return
        seq_id = request.seq_id
        try:
            self.matchers[seq_id] = self._compiler_for().compile(params)
        except ValueError as e:
            self._fail(seq_id, INVALID_ARGUMENT, f"structured_outputs cannot be compiled: {e}")
            return
        self._started[seq_id] = time.monotonic()
        if params.reasoning_end_ids:
            self._thinking[seq_id] = (params.reasoning_end_ids, [])
        num_prompt = request.num_prompt_tokens
        if num_prompt is not None and num_prompt < len(request.token_ids):
            for token in request.token_ids[num_prompt:]:
                self._advance(seq_id, token)

    def remove(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)
        self._replay.pop(seq_id, None)
        self._thinking.pop(seq_id, None)
        self._started.pop(seq_id, None)
        self._errors.pop(seq_id, None)

    def take_errors(self) -> list[RequestError]:
        """The requests failed since the last call (their rows are left out of every fill)."""
        errors, self._errors = list(self._errors.values()), {}
        return errors

    def take_deferred(self) -> list[int]:
        """The seq_ids the last fill deferred: their rows' tokens are void."""
        deferred, self._deferred = self._deferred, []
        return deferred

    def _fail(self, seq_id: int, code: int, message: str) -> None:
        self.remove(seq_id)
        self._errors[seq_id] = RequestError(seq_id, code, message)

    def accept(self, seq_ids: np.ndarray, tokens: np.ndarray) -> None:
        """Advances the matchers of `seq_ids` (a step's sampled rows) by their tokens."""
        for seq_id, token in zip(seq_ids.tolist(), tokens.tolist()):
            if seq_id in self.matchers:
                self._advance(seq_id, token)

    def _advance(self, seq_id: int, token: int) -> None:
        thinking = self._thinking.get(seq_id)
        if thinking is not None:
            end, recent = thinking
            recent.append(token)
            del recent[:-len(end)]
            if recent == end:
                del self._thinking[seq_id]
            return
        matcher = self.matchers[seq_id]
        if isinstance(matcher, Future):
            self._replay.setdefault(seq_id, []).append(token)
        else:
            matcher.accept(token)

    def fill(self, seq_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The indices into `seq_ids` that are constrained (and not thinking) and their bitmask
        rows ([k, words] int32, a view of a buffer the next fill overwrites); None when none is.
        Rows whose grammar is not ready (take_deferred) or failed (take_errors) are left out."""
        matchers, thinking = self.matchers, self._thinking
        self._deferred = []
        ready = []
        for i, seq_id in enumerate(seq_ids.tolist()):
            if seq_id in matchers and seq_id not in thinking:
                matcher = self._matcher(seq_id)
                if matcher is not None:
                    ready.append((i, matcher))
        if not ready:
            return None
        for k, (_, matcher) in enumerate(ready):
            matcher.fill(self.bitmask, k)
        return np.array([i for i, _ in ready], dtype=np.int64), self.bitmask[:len(ready)]

    def _matcher(self, seq_id: int) -> Matcher | None:
        """The request's matcher once compiled; None while deferred or once failed."""
        matcher = self.matchers[seq_id]
        if not isinstance(matcher, Future):
            return matcher
        waited = time.monotonic() - self._started[seq_id]
        try:
            matcher = matcher.result(0 if self._defer else max(0.0, GRAMMAR_TIMEOUT_S - waited))
        except Exception as e:  # noqa: BLE001 - whatever compiling raised concerns this request alone
            self._not_ready(seq_id, e, waited)
            return None
        self.matchers[seq_id] = matcher
        for token in self._replay.pop(seq_id, ()):
            matcher.accept(token)
        return matcher

    def _not_ready(self, seq_id: int, error: Exception, waited: float) -> None:
        """Defers the request's row while its grammar compiles, within the timeout; else fails it."""
        # Checked first: futures.TimeoutError is an OSError from Python 3.11 on.
        if isinstance(error, futures.TimeoutError):
            if self._defer and waited < GRAMMAR_TIMEOUT_S:
                self._deferred.append(seq_id)
                return
            self._fail(seq_id, INVALID_ARGUMENT, f"the structured output took more than {GRAMMAR_TIMEOUT_S:.0f} s "
                                                 "to compile; simplify its schema, regex or grammar")
        elif isinstance(error, OSError):
            self._fail(seq_id, FAILED_PRECONDITION, f"structured outputs need the model's tokenizer in the "
                                                    f"executor ({self._model_path}): {error}")
        else:
            self._fail(seq_id, INVALID_ARGUMENT, f"structured_outputs cannot be compiled: {error}")

    def _compiler_for(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(lambda: Tokenizer.load(self._model_path), self._vocab_size,
                                             self._eos_token_ids)
        return self._compiler
