"""FP8 W8A8 linear layers (vLLM's `--quantization fp8`): the decoder's projections hold FP8 E4M3
weights with a float32 scale per output channel, and quantize each token's activations with a
scale of its own as they arrive. A mixture of experts' stacked expert weights go FP8 the same
way, a scale per expert and output channel (kernels/fused_moe.py). The embedding, lm_head and MoE
routers keep the model dtype."""
import functools
from collections.abc import Callable

import torch
from torch import nn

from pagedserve.kernels.fp8_matmul import SMALL_BATCH, w8a8_matmul, w8a8_takes, w8a16_matmul
from pagedserve.kernels.fused_moe import quantize_experts_fp8
from pagedserve.kernels.reference import FP8_DTYPE, dequantize, per_token_quant_fp8_ref, quantize_experts_fp8_ref

QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Activations quantized per token: (FP8 [T, K], float32 scale [T, 1]).
Quantized = tuple[torch.Tensor, torch.Tensor]
# x [T, K] -> Quantized: the backend's per_token_quant_fp8.
Quantize = Callable[[torch.Tensor], Quantized]


class Fp8Linear(nn.Module):
    """x @ W.T + b, W in FP8 [out, in] with scale [out, 1]. W is kept row-major so that W.t() is
    the column-major operand torch._scaled_mm takes; a fused projection keeps its `shards`."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: nn.Parameter | None,
                 quantize: Quantize, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.register_parameter("bias", bias)
        self.quantize = quantize

    def forward(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        """x [..., in], or x [T, in] quantized already by the kernel before (see takes_quantized)."""
        if isinstance(x, tuple):
            return self._quantized_matmul(*x, x[0].shape[:-1])
        x2 = x.reshape(-1, self.in_features)
        if not takes_quantized(x2):
            out = w8a16_matmul(x2.contiguous(), self.weight, self.weight_scale, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return self._quantized_matmul(*self.quantize(x2), x.shape[:-1])

    def _quantized_matmul(self, q: torch.Tensor, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if q.is_cuda and w8a8_takes(q.shape[0], self.out_features):
            out = w8a8_matmul(q, scale, self.weight, self.weight_scale, self.bias, self.dtype)
        elif q.is_cuda or cpu_scaled_mm_takes_rows():
            # Fast accumulation: 12% off the row-wise GEMMs at 1024 tokens on an H200.
            out = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale.t(),
                                   bias=self.bias, out_dtype=self.dtype, use_fast_accum=q.is_cuda)
        else:
            out = dequantize(q, scale) @ dequantize(self.weight, self.weight_scale).t()
            out = (out if self.bias is None else out + self.bias).to(self.dtype)
        return out.view(*shape, self.out_features)


@functools.cache
def cpu_scaled_mm_takes_rows() -> bool:
    """Whether this torch's CPU torch._scaled_mm takes a scale a row: torch 2.11's (the Docker
    image's) takes one a tensor and fails an internal assert otherwise, and older ones may have no
    CPU kernel; Fp8Linear multiplies the dequantized operands there instead."""
    a, b = torch.zeros(2, 16, dtype=FP8_DTYPE), torch.zeros(16, 16, dtype=FP8_DTYPE)
    try:
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def takes_quantized(x: torch.Tensor) -> bool:
    """Whether an Fp8Linear quantizes activations x [T, in] rather than reading them in the
    model dtype, so that the kernel producing them may quantize them itself."""
    # A decode batch of at most SMALL_BATCH rows is bound by the weight read: at one token the
    # row-wise _scaled_mm (124 us a layer on an H200) is slower than bf16 (118 us), W8A16 72 us.
    return not (x.is_cuda and x.shape[0] <= SMALL_BATCH)


@torch.no_grad()
def quantize_linears(model: nn.Module, quantize: Quantize) -> None:
    """Replaces each loaded decoder projection with an Fp8Linear of its weights, quantized per
    output channel. One layer at a time, so each layer's full-precision weights are freed before
    the next is quantized."""
    def quantized(linear: nn.Linear) -> Fp8Linear:
        return Fp8Linear(*per_token_quant_fp8_ref(linear.weight), linear.bias, quantize, linear.weight.dtype)
    _replace_linears(model, quantized)


def fp8_linears(model: nn.Module, quantize: Quantize) -> None:
    """Replaces each decoder projection with an unfilled Fp8Linear, for an FP8 checkpoint's
    `weight` and `weight_scale` (and the bias, in the model dtype) to be loaded into."""
    def empty(linear: nn.Linear) -> Fp8Linear:
        device = linear.weight.device
        weight = torch.empty(linear.weight.shape, dtype=FP8_DTYPE, device=device)
        scale = torch.empty(linear.out_features, 1, dtype=torch.float32, device=device)
        return Fp8Linear(weight, scale, linear.bias, quantize, linear.weight.dtype)
    _replace_linears(model, empty)


@torch.no_grad()
def quantize_experts(model: nn.Module) -> None:
    """Quantizes each loaded mixture of experts' stacked weights (the parameters its
    `expert_shards` name, layers.moe.FusedExperts) to FP8 [E, N, K] with float32 scales
    `<name>_scale` [E, N, 1], one layer at a time."""
    def quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (quantize_experts_fp8 if weight.is_cuda else quantize_experts_fp8_ref)(weight)
    _replace_experts(model, quantized)


def fp8_experts(model: nn.Module) -> None:
    """Replaces each mixture of experts' stacked weights with unfilled FP8 ones and their scales,
    for an FP8 checkpoint's per-expert `weight` and `weight_scale` to be loaded into."""
    def empty(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device),
                torch.empty(*weight.shape[:2], 1, dtype=torch.float32, device=weight.device))
    _replace_experts(model, empty)


def check_fp8_device(device: torch.device, dtype: torch.dtype) -> None:
    """FP8 GEMMs need Ada or Hopper (compute capability 8.9+), and on a GPU torch's row-wise
    scaled GEMM writes only bfloat16."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"FP8 quantization needs a GPU of compute capability 8.9 or newer (Ada, "
                         f"Hopper); this one is {capability[0]}.{capability[1]}: use a bf16 checkpoint "
                         "without --quantization")
    if dtype != torch.bfloat16:
        raise ValueError(f"FP8 quantization runs in bfloat16 on a GPU, not {dtype}: pass --dtype bfloat16")


def _replace_linears(model: nn.Module, make: Callable[[nn.Linear], Fp8Linear]) -> None:
    names = [name for name, _ in model.named_modules() if name.rpartition(".")[2] in QUANTIZED_LINEARS]
    for name in names:
        linear = model.get_submodule(name)
        layer = make(linear)
        # What the weight loader reads off a module: fused shards, a rank's slice, skipped tensors.
        for attribute in ("shards", "tp_split", "skipped"):
            if hasattr(linear, attribute):
                setattr(layer, attribute, getattr(linear, attribute))
        model.set_submodule(name, layer)


def _replace_experts(model: nn.Module, make: Callable[[torch.Tensor], Quantized]) -> None:
    for module in model.modules():
        for name in dict.fromkeys(param for param, *_ in getattr(module, "expert_shards", {}).values()):
            weight, scale = make(getattr(module, name))
            setattr(module, name, nn.Parameter(weight, requires_grad=False))
            setattr(module, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
