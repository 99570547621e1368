"""RMSNorm, optionally fused with the residual add that precedes it and with the per-token FP8
quantization of its output that an FP8 projection after it needs; and the per-token scale of a
norm folded into the projection after it (`inv_rms`)."""
import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.quant import INTERPRETED, empty_quantized, store_quantized_row
from pagedserve.kernels.reference import FP8_MAX, FP8_MIN_SCALE


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, sum_out, scale, stride_x, stride_r, stride_o,
                     stride_s, hidden, eps, min_scale, HAS_RESIDUAL: tl.constexpr,
                     QUANT: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                     EXACT: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    # The weight is no kernel's output: read before the wait (see kernels/pdl.py).
    w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    pdl.wait_for_previous(PDL)
    h = tl.load(x + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to the activation dtype before normalising, as the unfused add would.
        h = (h.to(tl.float32) + tl.load(residual + row * stride_r + offs, mask=mask,
                                        other=0.0).to(tl.float32)).to(x.dtype.element_ty)
        tl.store(sum_out + row * stride_s + offs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, 0) / hidden + eps)
    normed = (hf * rstd * w).to(x.dtype.element_ty)
    if QUANT:
        # Quantized as rounded to the activation dtype, as the unfused quantization would read it.
        store_quantized_row(normed.to(tl.float32), mask, out + row * stride_o, offs, scale + row,
                            min_scale, FP8_MAX, EXACT)
    else:
        tl.store(out + row * stride_o + offs, normed, mask=mask)


@triton.jit
def inv_rms(x_row, hidden, eps, BLOCK: tl.constexpr):
    """1 / RMS of the `hidden` values at x_row, in fp32: the scale RMSNorm gives that row."""
    offs = tl.arange(0, BLOCK)
    h = tl.load(x_row + offs, mask=offs < hidden, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim of x; with `residual`, normalises x + residual in one pass.

    Returns (normed, x + residual) like `rms_norm_ref` (None in place of the sum without a
    residual), normed written into `out` if given (x's shape, rows contiguous). Out of place:
    neither x nor residual is modified.
    """
    x2 = x.reshape(-1, x.shape[-1])
    normed = torch.empty_like(x2) if out is None else out.view(x2.shape)
    _, summed = _launch(x2, weight, eps, residual, normed, None)
    return normed.view(x.shape), None if summed is None else summed.view(x.shape)


def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None
                       ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """x [T, hidden]: RMSNorm's output quantized per token, ((FP8 [T, hidden], float32 scale
    [T, 1]), x + residual or None), like `rms_norm_quant_fp8_ref`, in one pass."""
    q, scale = empty_quantized(x.shape[0], x.shape[1], x.device)
    out, summed = _launch(x, weight, eps, residual, q, scale)
    return (out, scale), summed


def _launch(x2: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
            out: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x2.shape[1]
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        sum_out = torch.empty_like(x2)
    else:
        r2 = sum_out = x2
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, sum_out, out if scale is None else scale, x2.stride(0),
            r2.stride(0), out.stride(0), sum_out.stride(0), hidden, eps, FP8_MIN_SCALE,
            HAS_RESIDUAL=residual is not None, QUANT=scale is not None,
            BLOCK=triton.next_power_of_2(hidden), FP8_MAX=FP8_MAX, EXACT=INTERPRETED,
            num_warps=8 if hidden >= 4096 else 4, **pdl.launch_args(x2.device))
    return out, sum_out if residual is not None else None
