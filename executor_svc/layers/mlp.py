"""The gated MLP: fused gate/up (column parallel), the activation `hidden_act` names, and
down_proj (row parallel, all-reduced here)."""
import torch
from torch import nn

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.fp8 import Quantized
from pagedserve.executor_svc.layers.activation import ACTIVATIONS
from pagedserve.executor_svc.layers.linear import column_linear, row_linear
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.parallel import TensorParallel


class GatedMLP(nn.Module):
    # Its first projection reads the norm's output quantized per token when the decoder runs in
    # FP8 (DecoderLayer asks): a block that must see the activations first, such as a MoE
    # router, says False.
    quantized_input = True

    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend, tp: TensorParallel | None) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = column_linear(config.hidden_size, {"gate_proj": size, "up_proj": size},
                                          config.mlp_bias, tp)
        self.down_proj = row_linear(size, config.hidden_size, config.mlp_bias, tp)
        act, act_quant_fp8 = ACTIVATIONS[config.hidden_act]
        self.act_and_mul = getattr(backend, act)
        self.act_and_mul_quant_fp8 = getattr(backend, act_quant_fp8)
        self.tp = tp

    def forward(self, x: torch.Tensor | Quantized, quantize: bool) -> torch.Tensor:
        """`quantize`: down_proj is FP8 and takes its input quantized by the activation."""
        h = self.gate_up_proj(x)
        h = self.act_and_mul_quant_fp8(h) if quantize else self.act_and_mul(h)
        out = self.down_proj(h)
        return out if self.tp is None else self.tp.all_reduce(out)
