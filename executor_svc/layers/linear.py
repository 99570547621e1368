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


# cuBLASLt runs o_proj and down_proj faster on 32 rows than on fewer. On an H200 (Llama-3.1-8B
# shape, 32 distinct weights in one CUDA graph, 2026-12-04), us a GEMM for 16 rows under cuBLAS /
# on 32 rows of the same buffer under cuBLASLt: o_proj 12.72 / 11.85, down_proj 31.16 / 30.49; for
# 24 rows 12.95 / 11.86 and 31.60 / 30.45; for 1 row 12.56 / 11.83 and 30.26 / 30.47. Copying the
# rows into a 32-row buffer first lost (13.39 and 32.90 for 16 rows), so the kernels before these
# projections write into such buffers themselves. qkv and gate_up, which read a norm's output,
# lost on 32 rows (16.02 against 15.64, 56.84 against 55.89 for 16) and take their rows as they are.
# A decode step (`bench latency`, 700-token prompts) took 4.502 ms against 4.535 at batch 1, 5.178
# against 5.215 at 16, 5.405 against 5.472 at 24; FP8 models, whose projections are no `Linear`,
# are left as they were. Some shapes run faster still on 64 rows: the worker measures which, per
# model (executor_svc/projection_rows.py), and sets their `min_rows`.
PROJECTION_ROWS = 32
# gate_up, though, ran faster on 64 rows than on 33-63 under cuBLASLt (same setup): 59.84 against
# 61.47 us for 40 rows, 59.80 against 62.00 for 48, 59.91 against 62.08 for 56; o_proj and down_proj
# lost on 64 rows (32.01 against 31.69 for down_proj at 48), and a fused projection of 32 rows on 64
# too (59.76 against 58.42). The norm before gate_up writes such a buffer, and the activation and
# down_proj then run on its rows too: a decode step took 5.650 ms against 5.662 at batch 40, 5.785
# against 5.824 at 48, 5.981 against 6.062 at 56 (unchanged at 16 and 32).
FUSED_ROWS = 64


class Uninitialized:
    """Leaves a torch layer's parameters as allocated: the weight loader fills every one, and
    nn.Linear's and nn.Embedding's random init took 0.7-1.2 s of the default model's build on the
    2-core machine (its load then takes about 0.3 s more, the first to touch the memory)."""

    def reset_parameters(self) -> None:
        """Nothing to initialise: see the class."""


class CheckpointLinear(Uninitialized, nn.Linear):
    """An nn.Linear whose weights come from the checkpoint."""


class Linear(CheckpointLinear):
    """A decoder projection: what narrow_linears may store narrower than the activations."""
    # The rows a row-parallel one runs steps of up to PROJECTION_ROWS tokens on, on a GPU.
    min_rows = PROJECTION_ROWS


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


class Embedding(Uninitialized, nn.Embedding):
    """nn.Embedding looked up by indexing: on an H200 (Llama-3.1-8B's table, in a CUDA graph)
    1.50 us at 16 rows against 7.63 through F.embedding's kernel, 2.74 against 1.87 at one row."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[input_ids]


class VocabParallelEmbedding(Embedding):
    """This rank's rows [rank * n, (rank + 1) * n) of the embedding table: ids outside them give
    zero rows, and the all-reduce fills in the other ranks' rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__(num_embeddings, embedding_dim)
        shard(self, tp, 0)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.tp.rank * self.num_embeddings
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0))
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



def input_rows(projection: nn.Module, num_tokens: int) -> int:
    """Rows of the buffer that the kernel before `projection` writes its num_tokens rows of input
    into, for a model-dtype projection on a GPU: a row-parallel one's (o_proj, down_proj) min_rows
    up to PROJECTION_ROWS tokens, a fused one's (gate_up) FUSED_ROWS between PROJECTION_ROWS and
    FUSED_ROWS, else num_tokens. The rows past num_tokens are padding whose products the caller
    drops."""
    if not (isinstance(projection, Linear) and projection.weight.is_cuda):
        return num_tokens
    if isinstance(projection, MergedLinear):
        return FUSED_ROWS if PROJECTION_ROWS < num_tokens < FUSED_ROWS else num_tokens
    return projection.min_rows if num_tokens <= PROJECTION_ROWS else num_tokens


def add_projection(stream: torch.Tensor, x: torch.Tensor, projection: Linear) -> None:
    """stream += x @ projection's weight.T, in place: how a folded layer's o_proj and down_proj run
    (decoder.fold_norms), their products added into the residual stream."""
    stream.addmm_(x, projection.weight.t())


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> Linear:
    if tp is None:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


# A narrowed projection whose weights lie on a 4-bit grid (the default model's Q4_1 GGUF) also
# keeps them as their codes for torch's CPU int4 kernel, which steps of at most INT4_MAX_ROWS rows
# run. SmolLM2's 30 layers of projections (distinct weights) took, at 1 / 4 / 8 / 10 / 16 rows,
# 4.5 / 6.6 / 12.1 / 17.3 / 22.4 ms with it and 13.0 / 13.2 / 13.2 / 13.3 / 13.7 ms in packed
# bfloat16 (two threads, the 2-core machine): the int4 kernel dequantizes its weights anew for
# every few rows.
INT4_MAX_ROWS = 8
INT4_GROUP = 32


def narrow_linears(model: nn.Module, dtype: torch.dtype) -> None:
    """Stores the weights of the model's decoder projections (its `Linear`s) in `dtype` (bfloat16
    under float32 on a CPU: executor_svc/device.py's resolve_linear_dtype), laid out once for
    oneDNN's inner product, and also as 4-bit codes where they are on a 4-bit grid (`int4_grid`);
    their input is cast to `dtype` and their output back. A forward of its own, so that a model
    not narrowed (every GPU) pays for no cast."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.int4 = int4_grid(module.weight.detach())
            module.to(dtype)
            # torch's linear lays a bfloat16 weight out for oneDNN on every call: SmolLM2's 30
            # layers of projections at one row took 29 ms that way and 21 ms packed once (one
            # thread, the 2-core machine).
            module.weight = nn.Parameter(pack(module.weight.detach()), requires_grad=False)
            module.forward = partial(_narrowed_forward, module, dtype)


def int4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """weight [N, K] as 4-bit codes packed for `_weight_int4pack_mm_for_cpu`, with a scale and
    offset per group of INT4_GROUP inputs (bfloat16), when each group's values are low + code *
    step for codes 0 to 15, its least value at code 0 and its greatest at 15 (as a Q4_1 GGUF's
    are); else None."""
    n, k = weight.shape
    # The packing's own constraint on N.
    if k % INT4_GROUP or n % 16:
        return None
    w = weight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    low = w.amin(-1, keepdim=True)
    step = (w.amax(-1, keepdim=True) - low) / 15
    codes = ((w - low) / step.clamp(min=torch.finfo(torch.float32).tiny)).round()
    if ((codes * step + low - w).abs() > 0.01 * step).any():
        return None
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int().reshape(n, k), 1)
    # The kernel computes (code - 8) * scale + zero.
    scales = torch.cat((step, low + 8 * step), -1).transpose(0, 1).to(torch.bfloat16).contiguous()
    return packed, scales


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [N, K] laid out once for oneDNN's inner product (`packed_linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# The LM head runs int8 codes with a scale per vocabulary row (torch's `_weight_int8pack_mm`) at
# steps of up to HEAD_INT8_MAX_ROWS rows, the bfloat16 copy at more. A 49152 x 576 head, median ms
# of 30 interleaved calls at 1 / 2 / 3 / 4 / 6 / 8 rows (two threads, the 2-core machine): int8
# 3.68 / 3.93 / 4.43 / 4.75 / 7.48 / 7.87, packed bfloat16 5.23 / 5.38 / 5.43 / 5.09 / 5.25 /
# 5.34. The head inside SmolLM2's one-stream steps of random token ids (384 alternating calls,
# recomputation included): 3.79 against 4.92 ms at the median, 3.46 against 4.42 at the fastest
# tenth.
HEAD_INT8_MAX_ROWS = 3
# A narrow logit is off from float32's by at most |hidden| times its copy's bound
# (NarrowHead.__init__), and by far less in practice: on 716 rows of SmolLM2 hidden states (140
# from chat prompts, 576 from random token ids; three runs, whose sampled chats differ), by at
# most 0.087 of it for the bfloat16 copy and 0.073 for int8. A logit and its row's greatest can
# swap order only within twice that, and NarrowHead recomputes the logits within HEAD_SAFETY times
# twice the shares below of their row's greatest: for bfloat16 about 2 a row from chat prompts
# and 5 from random ids (at most 61), for int8 about 11 and 128 (at most 1,978).
HEAD_ERROR_SHARE = {torch.bfloat16: 0.1, torch.int8: 0.08}
HEAD_SAFETY = 2.5


class NarrowHead:
    """An LM head's logits from a narrow copy of its float32 weight (int8 codes with a scale per
    vocabulary row at few rows, bfloat16 laid out for oneDNN at more), with every logit that could
    be its row's greatest recomputed in float32: the only ones a greedy argmax or a nucleus can
    turn on. The rest keep the copy's rounding, as llama.cpp's int8 products give its own logits.
    On the 2-core machine the head took 4.2 ms a step for one row in float32 (SmolLM2's 49152 x
    576, two threads); bfloat16 logits alone moved greedy tokens onto near ties (425 of 1,024 equal
    to float32's, against 915 with the float32 head)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self.packed = pack(self.weight.to(torch.bfloat16))
        # Each row's step rounded up in bfloat16 (whose rounding is within 2^-8), so that no code
        # passes 127.
        peaks = torch.linalg.vector_norm(self.weight, float("inf"), dim=1)
        self.scales = (peaks / 127 * (1 + 2.0**-7)).to(torch.bfloat16)
        steps = self.scales.float().clamp(min=torch.finfo(torch.float32).tiny)
        self.codes = torch.div(self.weight, steps[:, None]).round_().to(torch.int8)
        # |h.w - h'.w'| <= |h| (|w - w'| + 2^-8 |w'|) (Cauchy-Schwarz), where h' is h in bfloat16
        # and w' a row of the narrow copy: bfloat16 holds each weight within 2^-8 of it, int8
        # within half its row's step. Per unit of |h|, computed without a pass over the errors
        # (those passes made the head's start 0.85 s, not 0.09).
        norm = torch.linalg.vector_norm(self.weight, dim=1).max().item()
        int8_error = steps.max().item() / 2 * self.weight.shape[1] ** 0.5
        self.margins = {torch.bfloat16: _head_margin(torch.bfloat16, 2.0**-8 * norm, norm),
                        torch.int8: _head_margin(torch.int8, int8_error, norm)}

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        narrow = hidden.to(torch.bfloat16)
        if len(narrow) <= HEAD_INT8_MAX_ROWS:
            logits, copy = torch._weight_int8pack_mm(narrow, self.codes, self.scales), torch.int8
        else:
            logits, copy = packed_linear(narrow, self.packed), torch.bfloat16
        logits = logits.float()
        margin = self.margins[copy] * hidden.norm(dim=-1, keepdim=True)
        rows, cols = (logits >= logits.amax(-1, keepdim=True) - margin).nonzero(as_tuple=True)
        # index_select, not advanced indexing: 0.19 against 1.3 ms for 1,024 of SmolLM2's rows.
        exact = (torch.index_select(self.weight, 0, cols) * torch.index_select(hidden, 0, rows)).sum(-1)
        logits.view(-1).index_copy_(0, rows * logits.shape[1] + cols, exact)
        return logits


def _head_margin(copy: torch.dtype, weight_error: float, norm: float) -> float:
    return HEAD_SAFETY * 2 * HEAD_ERROR_SHARE[copy] * (weight_error + 2.0**-8 * (norm + weight_error))


def _narrowed_forward(module: Linear, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    rows = x.to(dtype)
    if module.int4 is not None and len(rows) <= INT4_MAX_ROWS:
        # torch's own binding: 2.4 us a call less than torch.ops.aten's (120 calls a step).
        out = torch._weight_int4pack_mm_for_cpu(rows, module.int4[0], INT4_GROUP, module.int4[1])
        out = out if module.bias is None else out + module.bias
    else:
        out = packed_linear(rows, module.weight, module.bias)
    return out.to(x.dtype)


def embedding(num_embeddings: int, embedding_dim: int, tp: TensorParallel | None) -> Embedding:
    if tp is None:
        return Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(num_embeddings, embedding_dim, tp)
