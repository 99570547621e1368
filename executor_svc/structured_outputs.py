"""The grammar state of the running requests that have a structured output, and the token bitmask
of the rows that sample.

It lives in the executor, not beside the scheduler as in vLLM: the executor has each sampled token
on the host as soon as the device does, so a matcher advances without a round trip, and the
bitmask (6 KB per row for a 49k vocabulary, 16 KB for 128k) is filled where it is applied instead
of crossing gRPC in every plan. Only the constraint's text travels, once, in SamplingParams. With
two steps in flight the runner settles the step in flight before filling the mask (as for
penalties), after launching the forward, so the fill overlaps the device's work."""
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
        # Outputs sampled before a preemption, replayed into the new matcher once it compiles.
        self._replay: dict[int, list[int]] = {}
        self.bitmask = np.zeros((max_seqs, -(-vocab_size // 32)), dtype=np.int32)

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def add(self, request: NewRequest) -> None:
        params = request.sampling.structured_outputs
        if params is None:
            return
        self.matchers[request.seq_id] = self._compiler_for().compile(params)
        num_prompt = request.num_prompt_tokens
        if num_prompt is not None and num_prompt < len(request.token_ids):
            self._replay[request.seq_id] = request.token_ids[num_prompt:]

    def remove(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)
        self._replay.pop(seq_id, None)

    def accept(self, seq_ids: np.ndarray, tokens: np.ndarray) -> None:
        """Advances the matchers of `seq_ids` (a step's sampled rows) by their tokens."""
        for seq_id, token in zip(seq_ids.tolist(), tokens.tolist()):
            if seq_id in self.matchers:
                self._matcher(seq_id).accept(token)

    def fill(self, seq_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The indices into `seq_ids` that are constrained and their bitmask rows ([k, words]
        int32, a view of a buffer the next fill overwrites); None when none is."""
        index = np.array([i for i, s in enumerate(seq_ids.tolist()) if s in self.matchers], dtype=np.int64)
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
            self._compiler = GrammarCompiler(lambda: Tokenizer.load(self._model_path).to_json(),
                                             self._vocab_size, self._eos_token_ids)
        return self._compiler
