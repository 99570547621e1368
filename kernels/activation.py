"""SwiGLU activation: silu(gate) * up."""
import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl


@triton.jit
def _silu_and_mul_kernel(x, out, stride_x, stride_o, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x + row * stride_x + offs, mask=mask).to(tl.float32)
    up = tl.load(x + row * stride_x + d + offs, mask=mask).to(tl.float32)
    tl.store(out + row * stride_o + offs, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty),
             mask=mask)


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
