"""RMSNorm, optionally fused with the residual add that precedes it."""
import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, sum_out, stride_x, stride_r, stride_o, stride_s,
                     hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
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
    tl.store(out + row * stride_o + offs, (hf * rstd * w).to(out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim of x; with `residual`, normalises x + residual in one pass.

    Returns (normed, x + residual) like `rms_norm_ref` (None in place of the sum without a
    residual). Out of place: neither x nor residual is modified.
    """
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    out = torch.empty_like(x2)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        sum_out = torch.empty_like(x2)
    else:
        r2 = sum_out = x2
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, sum_out, x2.stride(0), r2.stride(0), out.stride(0),
            sum_out.stride(0), hidden, eps, HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden), num_warps=8 if hidden >= 4096 else 4,
            **pdl.launch_args(x.device))
    if residual is None:
        return out.view(x.shape), None
    return out.view(x.shape), sum_out.view(x.shape)
