"""The offline LLM's pooling methods, vLLM's: embed, classify and score, on a pooling model
(--runner pooling). Each input is one pooling request through the same scheduler and runner as
the server's Pool RPC."""
import math
from dataclasses import replace
from typing import Sequence

from tqdm import tqdm

from pagedserve.common.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                                       EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput,
                                       ScoringRequestOutput)
from pagedserve.common.pooling_params import PoolingParams
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.score_inputs import pair_input
from pagedserve.scheduler_svc.request import Request, RequestDelta

# One input: its token ids and their token types (empty: all zeros).
Input = tuple[list[int], list[int]]


class Pooling:
    """LLM's pooling methods (a base of LLM, whose engine, tokenizer and counters they use)."""

    def embed(self, prompts: str | dict | Sequence[str | dict], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or {"prompt_token_ids": [...]}), in order."""
        params = replace(pooling_params or PoolingParams(), task="embed")
        inputs = [(self._tokenize(p)[1], []) for p in _as_list(prompts)]
        return [PoolingRequestOutput(request_id, EmbeddingOutput(data), ids)
                for request_id, (ids, _), data in zip(*self._pool(inputs, params, use_tqdm), strict=True)]

    def classify(self, prompts: str | dict | Sequence[str | dict], pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """One probability per label (one score for a reranker) per prompt, in order."""
        params = replace(pooling_params or PoolingParams(), task="classify")
        inputs = [(self._tokenize(p)[1], []) for p in _as_list(prompts)]
        return [PoolingRequestOutput(request_id, ClassificationOutput(data), ids)
                for request_id, (ids, _), data in zip(*self._pool(inputs, params, use_tqdm), strict=True)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """The relevance of each pair: one text_1 against every text_2, or text_1[i] against
        text_2[i]. A cross-encoder (a classifier of one label, a Qwen3-Reranker too) scores the
        pair as one input; an embedding model the cosine of the two embeddings (vLLM's)."""
        pairs = _pairs(data_1, data_2)
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model} has no tokenizer, which score() needs; use embed() "
                             "or classify() with token-id prompts")
        if "classify" in self.pooling.tasks:
            return self._cross_score(pairs, pooling_params, use_tqdm)
        outs = self.embed([text for pair in pairs for text in pair], pooling_params, use_tqdm)
        return [PoolingRequestOutput(first.request_id, ScoringOutput(_cosine(first.outputs.embedding,
                                                                             second.outputs.embedding)),
                                     first.prompt_token_ids + second.prompt_token_ids)
                for first, second in zip(outs[::2], outs[1::2])]

    def _cross_score(self, pairs: list[tuple[str, str]], pooling_params: PoolingParams | None,
                     use_tqdm: bool) -> list[ScoringRequestOutput]:
        if self.pooling.num_labels != 1:
            raise ValueError(f"score() needs a classifier of one label (a reranker); this model has "
                             f"{self.pooling.num_labels}: use classify()")
        params = replace(pooling_params or PoolingParams(), task="classify")
        inputs = [pair_input(self.tokenizer, first, second) for first, second in pairs]
        return [PoolingRequestOutput(request_id, ScoringOutput(data[0]), ids)
                for request_id, (ids, _), data in zip(*self._pool(inputs, params, use_tqdm), strict=True)]

    def _pool(self, inputs: list[Input], params: PoolingParams,
              use_tqdm: bool) -> tuple[list[str], list[Input], list[list[float]]]:
        """Runs every input as a pooling request; returns their request ids, the inputs and
        their pooled data, in order."""
        seq_ids, request_ids = [], []
        try:
            for ids, types in inputs:
                seq_ids.append(next(self._seq_ids))
                request_ids.append(str(next(self._request_ids)))
                self.scheduler.add(Request(seq_ids[-1], request_ids[-1], ids, SamplingParams(), pooling=params,
                                           token_type_ids=types))
        except ValueError:
            for seq_id in seq_ids:
                self.scheduler.abort(seq_id)
            raise
        pooled: dict[int, list[float]] = {}
        errors: list[str] = []
        bar = tqdm(total=len(inputs), desc="Processed prompts", disable=not use_tqdm)

        def deliver(outputs: list[RequestDelta]) -> None:
            for out in outputs:
                if out.error is not None:
                    errors.append(out.error)
                pooled[out.seq_id] = out.pooled
            bar.update(len(outputs))

        # Every input runs to its end, so that a failed one leaves nothing queued behind it.
        self.steps.run_sync(self.transport, deliver)
        bar.close()
        if errors:
            # As a request the scheduler refuses: the offline API reports bad input by raising.
            raise ValueError(errors[0])
        return request_ids, inputs, [pooled[seq_id] for seq_id in seq_ids]


def _as_list(prompts: str | dict | Sequence[str | dict]) -> list[str | dict]:
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)


def _pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 with each text_2, else text_1[i] with text_2[i]."""
    first, second = _as_list(data_1), _as_list(data_2)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"score() pairs text_1[i] with text_2[i]: got {len(first)} and {len(second)} texts; "
                         "pass one text_1 or as many as text_2")
    return list(zip(first, second))


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))
