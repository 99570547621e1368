"""The sparse mixture-of-experts block (Qwen2-MoE, Qwen3-MoE, Mixtral): a replicated router
picks each token's top-k experts (the backend's `route`), every expert's gated MLP runs in one
fused kernel over the experts' stacked weights (`fused_moe`), and an optional shared expert,
scaled per token by a sigmoid gate (Qwen2-MoE), adds its output.

Under tensor parallelism each rank holds its slice of every expert's intermediate dim, as a
GatedMLP holds its slice of one, and the block all-reduces once. Nothing here reads a device
value on the host or loops over experts, so a decode step's experts replay in a CUDA graph."""
from dataclasses import dataclass, replace

import torch
from torch import nn

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.layers.linear import CheckpointLinear, shard
from pagedserve.executor_svc.layers.mlp import GatedMLP
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.parallel import TensorParallel


@dataclass(slots=True)
class MoeShape:
    """A model's experts, with one rank's share of each intermediate width."""
    num_experts: int
    top_k: int
    intermediate_size: int
    # Whether a token's top-k routing weights are divided by their sum.
    renormalize: bool
    # The shared expert's intermediate width (Qwen2-MoE); 0: no shared expert.
    shared_intermediate_size: int = 0


def moe_shape(config: ModelConfig, tp: TensorParallel | None, renormalize: bool | None = None) -> MoeShape:
    """The experts config.json describes: Qwen's num_experts, moe_intermediate_size,
    norm_topk_prob and shared_expert_intermediate_size, or Mixtral's num_local_experts, whose
    experts are intermediate_size wide (the rank's share already: parallel.shard_config).
    `renormalize` overrides norm_topk_prob (Mixtral always renormalizes)."""
    hf = config.hf_config
    parts = 1 if tp is None else tp.size
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts.
    num_experts = hf.get("num_experts") or hf["num_local_experts"]
    intermediate = config.intermediate_size
    if "moe_intermediate_size" in hf:
        intermediate = hf["moe_intermediate_size"] // parts
    if renormalize is None:
        renormalize = bool(hf.get("norm_topk_prob", False))
    return MoeShape(num_experts, hf["num_experts_per_tok"], intermediate, renormalize,
                    hf.get("shared_expert_intermediate_size", 0) // parts)


class FusedExperts(nn.Module):
    """Every expert's gated MLP, stacked as kernels/fused_moe.py lays them out: w13 [E, 2I, H]
    (each expert's gate_proj rows, then its up_proj rows) and w2 [E, H, I] (its down_proj), I
    this rank's share; once quantized to FP8 (fp8.quantize_experts) also w13_scale [E, 2I, 1] and
    w2_scale [E, H, 1]. The weight loader fills them from each expert's checkpoint tensors
    `{e}.gate_proj.weight`, `{e}.up_proj.weight`, `{e}.down_proj.weight`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 backend: TorchAttentionBackend, tp: TensorParallel | None) -> None:
        super().__init__()
        size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, size))
        self.register_parameter("w13_scale", None)
        self.register_parameter("w2_scale", None)
        # Each expert's checkpoint tensor -> (parameter, first row, rows, the dim a rank's slice
        # cuts): gate and up split their output rows as a column-parallel linear does, down its
        # input columns as a row-parallel one.
        self.expert_shards = {"gate_proj": ("w13", 0, size, 0), "up_proj": ("w13", size, size, 0),
                              "down_proj": ("w2", 0, hidden_size, 1)}
        shard(self, tp, 0)
        self.fused_moe = backend.fused_moe

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], each token's routing weights and expert ids [T, k] -> the weighted sum of its
        experts' outputs [T, H] (this rank's partial sum under tensor parallelism)."""
        return self.fused_moe(x, self.w13, self.w2, weights, ids, w13_scale=self.w13_scale,
                              w2_scale=self.w2_scale)


class SparseMoeBlock(nn.Module):
    """The router `gate` (a replicated linear, kept out of FP8 quantization), the `experts`, and
    for a shape with one the `shared_expert` (a GatedMLP) and its `shared_expert_gate`; the
    names are Hugging Face's (Mixtral's are renamed to them: models/moe.py)."""
    # The router reads the norm's output in the model dtype, not quantized for an FP8 projection.
    quantized_input = False

    def __init__(self, config: ModelConfig, shape: MoeShape, backend: TorchAttentionBackend,
                 tp: TensorParallel | None) -> None:
        super().__init__()
        self.gate = CheckpointLinear(config.hidden_size, shape.num_experts, bias=False)
        self.experts = FusedExperts(shape.num_experts, config.hidden_size, shape.intermediate_size,
                                    backend, tp)
        self.shared_expert = None
        if shape.shared_intermediate_size:
            shared = replace(config, intermediate_size=shape.shared_intermediate_size)
            self.shared_expert = GatedMLP(shared, backend, tp, reduce_results=False)
            self.shared_expert_gate = CheckpointLinear(config.hidden_size, 1, bias=False)
        self.route = backend.route
        self.top_k, self.renormalize = shape.top_k, shape.renormalize
        self.tp = tp

    def input_rows(self, num_tokens: int) -> int:
        """No padding rows: the router would send them to experts."""
        return num_tokens

    def forward(self, x: torch.Tensor, quantize: bool) -> torch.Tensor:
        """x [T, H] in the model dtype; `quantize`: the shared expert's down_proj is FP8 and takes
        its input quantized by the activation."""
        weights, ids = self.route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, quantize)
        # One all-reduce for the routed and the shared experts' partial sums.
        return out if self.tp is None else self.tp.all_reduce(out)
