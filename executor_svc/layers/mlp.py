"""The gated MLP: fused gate/up (column parallel), the activation `hidden_act` names, and
down_proj (row parallel, all-reduced here)."""
import torch
from torch import nn

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend, first_rows
from pagedserve.executor_svc.fp8 import Quantized
from pagedserve.executor_svc.layers.activation import ACTIVATIONS
from pagedserve.executor_svc.layers.linear import add_projection, column_linear, input_rows, row_linear
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.parallel import TensorParallel


class GatedMLP(nn.Module):
    # Its first projection reads the norm's output quantized per token when the decoder runs in
    # FP8 (DecoderLayer asks): a block that must see the activations first, such as a MoE
    # router, says False.
    quantized_input = True

    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend, tp: TensorParallel | None,
                 reduce_results: bool = True) -> None:
        """reduce_results=False leaves the all-reduce of the ranks' partial sums to the caller
        (a mixture of experts adds its shared expert's to the routed experts' and reduces once)."""
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = column_linear(config.hidden_size, {"gate_proj": size, "up_proj": size},
                                          config.mlp_bias, tp)
        self.down_proj = row_linear(size, config.hidden_size, config.mlp_bias, tp)
        act, act_quant_fp8 = ACTIVATIONS[config.hidden_act]
        self.act_and_mul = getattr(backend, act)
        self.act_and_mul_quant_fp8 = getattr(backend, act_quant_fp8)
        # The group whose ranks' partial sums this block all-reduces (None: no reduce here).
        self.tp = tp if reduce_results else None

    def input_rows(self, num_tokens: int) -> int:
        """Rows of the buffer the norm before this block writes num_tokens rows into."""
        return input_rows(self.gate_up_proj, num_tokens)

    def forward(self, x: torch.Tensor | Quantized, quantize: bool) -> torch.Tensor:
        """`quantize`: down_proj is FP8 and takes its input quantized by the activation."""
        h = self.gate_up_proj(x)
        num_tokens = len(h)
        if quantize:
            h = self.act_and_mul_quant_fp8(h)
        else:
            h = self.act_and_mul(h, input_rows(self.down_proj, num_tokens))
        out = first_rows(self.down_proj(h), num_tokens)
        return out if self.tp is None else self.tp.all_reduce(out)

    def accumulate(self, x: torch.Tensor, num_tokens: int, eps: float) -> None:
        """x += this block's output, where the RMSNorm (of `eps`) before it is folded into
        gate_up_proj (decoder.fold_norms): x is the residual stream itself, not its norm, its
        first num_tokens rows the tokens' (the rest padding, which down_proj adds into too)."""
        h = self.act_and_mul(self.gate_up_proj(x[:num_tokens]), len(x), norm_of=(x, eps))
        add_projection(x, h, self.down_proj)
