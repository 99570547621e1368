"""The decoder's linear layers and embedding, whole or tensor parallel.

A fused projection (`MergedLinear`) stacks several checkpoint projections along its output dim;
its `shards` tell the weight loader where each Hugging Face tensor goes. Under tensor parallelism
a sharded module's `tp_split` tells the weight loader which slice of each checkpoint tensor it
holds: column-parallel layers split the output dim, row-parallel ones the input dim (the caller
all-reduces their partial products), the embedding and LM head the vocabulary."""
import itertools
from functools import partial

import torch
from torch import nn

from pagedserve.executor_svc.parallel import TensorParallel


class Linear(nn.Linear):
    """A decoder projection: what narrow_linears may store narrower than the activations."""


class MergedLinear(Linear):
    """Several checkpoint projections stacked along the output dim, run as one matmul."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        starts = itertools.accumulate(shard_sizes.values(), initial=0)
        self.shards = {name: (start, size) for (name, size), start in zip(shard_sizes.items(), starts)}


class RowParallelLinear(Linear):
    """This rank's slice of a projection's input dim; the caller all-reduces the partial products.
    Only rank 0 holds the bias, so the sum adds it once; the other ranks skip the checkpoint's."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias and tp.rank == 0)
        shard(self, tp, 1)
        self.skipped = ("bias",) if bias and tp.rank else ()


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [rank * n, (rank + 1) * n) of the embedding table: ids outside them give
    zero rows, and the all-reduce fills in the other ranks' rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__(num_embeddings, embedding_dim)
        shard(self, tp, 0)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.tp.rank * self.num_embeddings
        outside = (local < 0) | (local >= self.num_embeddings)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))


def shard(module: nn.Module, tp: TensorParallel | None, dim: int) -> nn.Module:
    """Marks `module`'s parameters as this rank's slice of the checkpoint's along `dim` (those
    with that dim: a row-parallel bias is whole)."""
    if tp is not None:
        module.tp_split = (dim, tp.rank, tp.size)
    return module


def column_linear(in_features: int, shard_sizes: dict[str, int], bias: bool,
                  tp: TensorParallel | None) -> MergedLinear:
    """A fused projection whose output dim (each of its shards) is split across the ranks."""
    return shard(MergedLinear(in_features, shard_sizes, bias), tp, 0)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> Linear:
    if tp is None:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def narrow_linears(model: nn.Module, dtype: torch.dtype) -> None:
    """Stores the weights of the model's decoder projections (its `Linear`s) in `dtype` (bfloat16
    under float32 on a CPU: executor_svc/device.py's resolve_linear_dtype), laid out once for
    oneDNN's inner product; their input is cast to `dtype` and their output back. A forward of
    its own, so that a model not narrowed (every GPU) pays for no cast."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.to(dtype)
            # torch's linear lays a bfloat16 weight out for oneDNN on every call: SmolLM2's 30
            # layers of projections at one row took 29 ms that way and 21 ms packed once (one
            # thread, the 2-core machine).
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
            module.weight = nn.Parameter(packed, requires_grad=False)
            module.forward = partial(_narrowed_forward, module)


class NarrowHead:
    """An LM head's logits from a bfloat16 copy of its float32 weight, laid out for oneDNN, with
    the logits near each row's greatest recomputed in float32: the only ones a greedy argmax or a
    nucleus can turn on. The rest keep bfloat16's rounding, as every logit has on a GPU. On the
    2-core machine the head took 4.2 ms a step for one row in float32 (SmolLM2's 49152 x 576, two
    threads); bfloat16 logits alone moved greedy tokens onto near ties (425 of 1,024 equal to
    float32's, against 915 with the float32 head)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.to(torch.bfloat16))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.ops.mkldnn._linear_pointwise(hidden.to(torch.bfloat16), self.packed, None, "none", [], "")
        logits = logits.float()
        top = logits.amax(-1, keepdim=True)
        # bfloat16 logits were off by at most 0.2 at logits up to 46 (SmolLM2, 223 rows): the
        # margin is five times that there, and grows with the logits.
        rows, cols = (logits >= top - 1 - top.abs() / 16).nonzero(as_tuple=True)
        logits[rows, cols] = (hidden[rows].float() * self.weight[cols]).sum(-1)
        return logits


def _narrowed_forward(module: Linear, x: torch.Tensor) -> torch.Tensor:
    out = torch.ops.mkldnn._linear_pointwise(x.to(module.weight.dtype), module.weight, module.bias, "none", [], "")
    return out.to(x.dtype)


def embedding(num_embeddings: int, embedding_dim: int, tp: TensorParallel | None) -> nn.Embedding:
    if tp is None:
        return nn.Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(num_embeddings, embedding_dim, tp)
