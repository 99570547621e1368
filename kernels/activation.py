"""Gated activations: SwiGLU, silu(gate) * up, and GeGLU with the tanh GELU, gelu_tanh(gate) * up
(Gemma's), optionally quantized per token to FP8 for the FP8 projection after them."""
import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.norm import inv_rms
from pagedserve.kernels.quant import INTERPRETED, empty_quantized, store_quantized_row
from pagedserve.kernels.reference import FP8_MAX, FP8_MIN_SCALE

_TWO_LOG2E = tl.constexpr(2.8853900817779268)
SILU, GELU_TANH = 0, 1
_SILU = tl.constexpr(SILU)


@triton.jit
def tanh(x):
    """tanh in fp32 through one exp2 of a non-positive number (no overflow), within 1e-7 of it
    absolutely: Triton has no tanh that the CPU interpreter runs."""
    e = tl.math.exp2(tl.abs(x) * -_TWO_LOG2E)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _gate_up(x, row, stride_x, d, offs, mask):
    """x's row's gate and up at offs, in fp32."""
    gate = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    return gate, up


@triton.jit
def _gated(gate, up, ACT: tl.constexpr, DTYPE: tl.constexpr):
    """act(gate) * up in DTYPE."""
    if ACT == _SILU:
        h = gate * tl.sigmoid(gate)
    else:
        # PyTorch's gelu(approximate="tanh"); 0.7978845608028654 is sqrt(2 / pi).
        inner = (gate + 0.044715 * gate * gate * gate) * 0.7978845608028654
        h = 0.5 * gate * (1.0 + tanh(inner))
    return (h * up).to(DTYPE)


@triton.jit
def _gated_kernel(x, out, stream, stride_x, stride_o, stride_s, d, hidden, eps,
                  ACT: tl.constexpr, BLOCK: tl.constexpr, NORMED: tl.constexpr,
                  HIDDEN_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate, up = _gate_up(x, row, stride_x, d, offs, mask)
    if NORMED:
        # After gate's and up's loads, which the row sum's barrier would hold back.
        inv = inv_rms(stream + row * stride_s, hidden, eps, HIDDEN_PAD)
        gate *= inv
        up *= inv
    tl.store(out + row * stride_o + offs, _gated(gate, up, ACT, x.dtype.element_ty), mask=mask)


@triton.jit
def _gated_quant_kernel(x, out, scale, stride_x, stride_o, d, min_scale, ACT: tl.constexpr,
                        BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, EXACT: tl.constexpr,
                        PDL: tl.constexpr):
    # One program holds a whole row, for its absmax.
    pdl.wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    gate, up = _gate_up(x, row, stride_x, d, offs, mask)
    h = _gated(gate, up, ACT, x.dtype.element_ty).to(tl.float32)
    store_quantized_row(h, mask, out + row * stride_o, offs, scale + row, min_scale, FP8_MAX, EXACT)


# A folded norm's scale is summed anew by each program of a row, so steps of many tokens take
# a program a row, as the quantizing kernel does.
NORMED_WIDE_ROWS = 256


def _gated_and_mul(x: torch.Tensor, act: int, out: torch.Tensor | None,
                   norm_of: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if out is None:
        out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    stream, eps = norm_of if norm_of is not None else (x2, 0.0)
    wide = norm_of is not None and x2.shape[0] > NORMED_WIDE_ROWS
    block = triton.next_power_of_2(d) if wide else min(1024, triton.next_power_of_2(d))
    if x2.shape[0] > 0:
        _gated_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out2, stream, x2.stride(0), out2.stride(0), stream.stride(0), d, stream.shape[-1],
            eps, ACT=act, BLOCK=block, NORMED=norm_of is not None,
            HIDDEN_PAD=triton.next_power_of_2(stream.shape[-1]), num_warps=_warps(block),
            **pdl.launch_args(x.device))
    return out


def _warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _gated_and_mul_quant_fp8(x: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[1] // 2
    out, scale = empty_quantized(x.shape[0], d, x.device)
    block = triton.next_power_of_2(d)
    if x.shape[0] > 0:
        _gated_quant_kernel[(x.shape[0],)](
            x, out, scale, x.stride(0), out.stride(0), d, FP8_MIN_SCALE, ACT=act, BLOCK=block,
            FP8_MAX=FP8_MAX, EXACT=INTERPRETED, num_warps=_warps(block),
            **pdl.launch_args(x.device))
    return out, scale


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None,
                 norm_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [..., 2 * d] holding gate then up projections; returns silu(gate) * up [..., d], written
    into `out` if given (rows of d contiguous, e.g. the first rows of a larger buffer).
    norm_of=(stream, eps), where gate_up's input RMSNorm was folded into its weights: gate and up
    are first scaled per row by 1 / RMS(stream[row]) with that eps (stream [T, hidden])."""
    return _gated_and_mul(x, SILU, out, norm_of)


def silu_and_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2 * d] -> silu(gate) * up quantized per token, (FP8 [T, d], float32 scale [T, 1]),
    like `silu_and_mul_quant_fp8_ref`."""
    return _gated_and_mul_quant_fp8(x, SILU)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None,
                      norm_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [..., 2 * d] holding gate then up projections; returns gelu_tanh(gate) * up [..., d]
    (GELU's tanh approximation, Gemma's gelu_pytorch_tanh), like `gelu_tanh_and_mul_ref`; written
    into `out` and scaled by `norm_of` if given, as silu_and_mul does."""
    return _gated_and_mul(x, GELU_TANH, out, norm_of)


def gelu_tanh_and_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2 * d] -> gelu_tanh(gate) * up quantized per token, (FP8 [T, d], float32 scale
    [T, 1]), like `gelu_tanh_and_mul_quant_fp8_ref`."""
    return _gated_and_mul_quant_fp8(x, GELU_TANH)
