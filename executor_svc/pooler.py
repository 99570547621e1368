"""Pooling: each sequence's hidden states turned into what its request returns. The hidden states
of a step's sequences arrive packed ([T, hidden], one sequence after another); the pooler takes
the first (CLS), the mean (MEAN) or the last (LAST) of each, then for `embed` truncates to the
request's Matryoshka `dimensions` and L2-normalises, or for `classify` applies the model's
classifier head and its activation (sigmoid for one label, else softmax), as vLLM's poolers do."""
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.common.pooling_params import PoolingParams

Head = Callable[[torch.Tensor], torch.Tensor]


class Pooler:
    """pooling_type: CLS, MEAN or LAST. normalize, dimensions (0: full size) and activation are the
    model's defaults, which each request's PoolingParams may override. head: the classifier
    ([B, hidden] -> [B, num_labels]) of a model that classifies, else None."""

    def __init__(self, pooling_type: str, normalize: bool, dimensions: int, activation: bool,
                 head: Head | None) -> None:
        self.pooling_type, self.normalize, self.dimensions = pooling_type, normalize, dimensions
        self.activation, self.head = activation, head

    def __call__(self, hidden: torch.Tensor, seq_lens: list[int],
                 params: list[PoolingParams]) -> list[torch.Tensor]:
        """One float32 vector per sequence: its embedding, or its scores (one per label)."""
        pooled = pool(hidden, seq_lens, self.pooling_type)
        if any(p.task == "classify" for p in params):
            scores = self.head(pooled.to(hidden.dtype)).float()
        return [self._classify(scores[i], p) if p.task == "classify" else self._embed(pooled[i], p)
                for i, p in enumerate(params)]

    def _embed(self, x: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        x = x.float()[:params.dimensions or self.dimensions or None]
        normalize = self.normalize if params.normalize is None else params.normalize
        return F.normalize(x, dim=-1) if normalize else x

    def _classify(self, scores: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if not (self.activation if params.activation is None else params.activation):
            return scores
        return scores.sigmoid() if scores.numel() == 1 else scores.softmax(-1)


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
    """[T, hidden] of sequences packed one after another -> [B, hidden]: each one's first token
    (CLS), last token (LAST) or mean over its tokens (MEAN, accumulated in float32)."""
    lens = torch.tensor(seq_lens, device=hidden.device)
    ends = lens.cumsum(0)
    if pooling_type == "CLS":
        return hidden[ends - lens]
    if pooling_type == "LAST":
        return hidden[ends - 1]
    segments = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)
    sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, segments, hidden.float())
    return sums / lens[:, None]


def from_token_classifier(lm_head: torch.Tensor, true_id: int, false_id: int) -> Head:
    """The one-label head of a yes/no-token reranker (vLLM's classifier_from_token with
    is_original_qwen3_reranker): logit(yes) - logit(no) = hidden · (lm_head[yes] - lm_head[no]),
    whose sigmoid is the softmax probability of "yes" over the two."""
    weight = (lm_head[true_id].float() - lm_head[false_id].float())[None].to(lm_head.dtype)
    return lambda x: F.linear(x, weight)
