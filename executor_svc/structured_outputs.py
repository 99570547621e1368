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
token id, as vLLM does, which suits models whose </think> is one token)."""
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from pagedserve.common.grammar import GrammarCompiler, Matcher
from pagedserve.common.plan import NewRequest
from pagedserve.common.tokenizer import Tokenizer


class StructuredOutputs:
    """Matchers by seq_id; compiling starts when a request arrives, so it overlaps its prefill."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: list[int],
                 max_seqs: int) -> None:
        self._model_path = model_path
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

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def add(self, request: NewRequest) -> None:
        params = request.sampling.structured_outputs
        if params is None:
            return
        seq_id = request.seq_id
        self.matchers[seq_id] = self._compiler_for().compile(params)
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
        rows ([k, words] int32, a view of a buffer the next fill overwrites); None when none is."""
        matchers, thinking = self.matchers, self._thinking
        index = np.array([i for i, s in enumerate(seq_ids.tolist()) if s in matchers and s not in thinking],
                         dtype=np.int64)
        if not len(index):
            return None
        for k, seq_id in enumerate(seq_ids[index].tolist()):
            self._matcher(seq_id).fill(self.bitmask, k)
        return index, self.bitmask[:len(index)]

    def _matcher(self, seq_id: int) -> Matcher:
        matcher = self.matchers[seq_id]
        if isinstance(matcher, Future):
            # Compiled while the request's prefill ran; a grammar slower than that waits here.
            try:
                matcher = self.matchers[seq_id] = matcher.result()
            except (OSError, ValueError) as e:
                raise ValueError(f"structured outputs need the model's tokenizer in the executor "
                                 f"({self._model_path}): {e}") from e
            for token in self._replay.pop(seq_id, ()):
                matcher.accept(token)
        return matcher

    def _compiler_for(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(lambda: Tokenizer.load(self._model_path), self._vocab_size,
                                             self._eos_token_ids)
        return self._compiler
