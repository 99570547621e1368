"""SwiGLU activation: silu(gate) * up, optionally quantized per token to FP8 for the FP8
projection after it."""
import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.quant import INTERPRETED, empty_quantized, store_quantized_row
from pagedserve.kernels.reference import FP8_MAX, FP8_MIN_SCALE


@triton.jit
def _silu_and_mul(x, row, stride_x, d, offs, mask):
    gate = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    return (gate * tl.sigmoid(gate) * up).to(x.dtype.element_ty)


@triton.jit
def _silu_and_mul_kernel(x, out, stride_x, stride_o, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    tl.store(out + row * stride_o + offs, _silu_and_mul(x, row, stride_x, d, offs, mask), mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(x, out, scale, stride_x, stride_o, d, min_scale,
                               BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, EXACT: tl.constexpr,
                               PDL: tl.constexpr):
    # One program holds a whole row, for its absmax.
    pdl.wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    h = _silu_and_mul(x, row, stride_x, d, offs, mask).to(tl.float32)
    store_quantized_row(h, mask, out + row * stride_o, offs, scale + row, min_scale, FP8_MAX, EXACT)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] holding gate then up projections; returns silu(gate) * up [..., d]."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    if x2.shape[0] > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, **pdl.launch_args(x.device))
    return out.view(*x.shape[:-1], d)


def silu_and_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2 * d] -> silu(gate) * up quantized per token, (FP8 [T, d], float32 scale [T, 1]),
    like `silu_and_mul_quant_fp8_ref`."""
    d = x.shape[1] // 2
    out, scale = empty_quantized(x.shape[0], d, x.device)
    block = triton.next_power_of_2(d)
    if x.shape[0] > 0:
        _silu_and_mul_quant_kernel[(x.shape[0],)](
            x, out, scale, x.stride(0), out.stride(0), d, FP8_MIN_SCALE, BLOCK=block,
            FP8_MAX=FP8_MAX, EXACT=INTERPRETED, num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4,
            **pdl.launch_args(x.device))
    return out, scale
