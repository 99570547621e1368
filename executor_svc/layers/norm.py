"""RMSNorm with the residual add fused in, and optionally its output quantized for FP8."""
from collections.abc import Callable

import torch
from torch import nn

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.fp8 import Quantized

# size -> a norm over the last dim of that size: how a model hands its norm class to the pieces.
Norm = Callable[[int], nn.Module]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, backend: TorchAttentionBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quantize: bool = False,
                out_rows: int = 0) -> tuple[torch.Tensor | Quantized, torch.Tensor | None]:
        """(normed, x + residual); normed quantized per token for an FP8 projection if `quantize`,
        else with at least out_rows rows (padding past x's: see attention_backend)."""
        if quantize:
            return self.backend.rms_norm_quant_fp8(x, self.weight, self.eps, residual)
        return self.backend.rms_norm(x, self.weight, self.eps, residual, out_rows)
