"""Dynamic per-token FP8 quantization of activations: each row gets its own scale, absmax / 448."""
import torch
import triton
import triton.language as tl

from pagedserve.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

MAX_BLOCK = 4096


@triton.jit
def _round_to_e4m3(v):
    """Rounds fp32 values within ±448 to the nearest E4M3 value (ties to even), so that the
    cast after it is exact: the Triton interpreter's own fp32 -> fp8 rounding drops the carry
    into the exponent, and this makes the kernel give the same bits on a CPU as on a GPU."""
    bits = v.to(tl.uint32, bitcast=True)
    # Normal E4M3 values keep 3 of fp32's 23 mantissa bits.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Below 2**-6 E4M3 is subnormal, a multiple of 2**-9: adding 1.5 * 2**14 rounds to that grid.
    subnormal = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _per_token_quant_kernel(x, out, scale, stride_x, stride_o, hidden, min_scale,
                            FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, out_row = x + row * stride_x, out + row * stride_o
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        h = tl.load(x_row + offs, mask=offs < hidden, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(h))
    # div_rn: Triton's `/` on fp32 is PTX's approximate div.full, and torch's reference divides exactly.
    s = tl.maximum(tl.div_rn(tl.max(amax, 0), FP8_MAX), min_scale)
    tl.store(scale + row, s)
    for start in range(0, hidden, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hidden
        h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.clamp(tl.div_rn(h, s), -FP8_MAX, FP8_MAX))
        tl.store(out_row + offs, q.to(out.dtype.element_ty), mask=mask)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (FP8 E4M3 [T, K], float32 scale [T, 1]), like `per_token_quant_fp8_ref`."""
    num_tokens, hidden = x.shape
    out = torch.empty(num_tokens, hidden, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    if num_tokens > 0:
        _per_token_quant_kernel[(num_tokens,)](
            x, out, scale, x.stride(0), out.stride(0), hidden, FP8_MIN_SCALE, FP8_MAX=FP8_MAX,
            BLOCK=min(MAX_BLOCK, triton.next_power_of_2(hidden)), num_warps=8 if hidden >= 4096 else 4)
    return out, scale
