import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, assert_close
from pagedserve.kernels.reference import FP8_DTYPE, dequantize, rms_norm_ref, rotary_ref, write_kv_ref
from pagedserve.kernels.rotary import rotary_write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [4, 16])
def test_rotary_write_kv_matches_rotary_then_write_kv(dtype: torch.dtype, group: int,
                                                      block_size: int) -> None:
    run_case(dtype, dtype, group, block_size, None, exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [None, (0.25, 2.0)], ids=["unscaled", "scaled"])
def test_rotary_write_kv_into_fp8_cache(dtype: torch.dtype, scales: tuple[float, float] | None) -> None:
    """On values that need no rounding (e4m3 values times power-of-two scales, quarter-turn
    rotations): the Triton interpreter's fp32 -> fp8 cast does not carry a rounded-up mantissa
    into the exponent, so rounded values differ there from the GPU's."""
    kv_scales = scales and tuple(torch.tensor(s, device=DEVICE) for s in scales)
    run_case(dtype, FP8_DTYPE, 4, 16, kv_scales, exact=True)


# Partial rotary (only the table's rotary_dim leading dims of each head rotate; the rest pass
# through to q, k and the cache): Phi-4-mini's 96 of 128, a quarter of 64, and Phi-3-mini's
# full rotary of 96 dims, none of them powers of two but 64 and 16; into an fp8 cache too.
@pytest.mark.parametrize("head_dim, rotary_dim, cache_dtype", [
    (128, 96, torch.float32), (64, 16, torch.float32), (96, 96, torch.float32),
    (128, 96, FP8_DTYPE)], ids=["phi4-mini", "quarter", "phi3-mini", "phi4-mini-fp8-cache"])
def test_partial_rotary(head_dim: int, rotary_dim: int, cache_dtype: torch.dtype) -> None:
    scales = (torch.tensor(0.5, device=DEVICE), torch.tensor(2.0, device=DEVICE))
    run_case(torch.float32, cache_dtype, 2, 16, scales if cache_dtype == FP8_DTYPE else None,
             exact=cache_dtype == FP8_DTYPE, head_dim=head_dim, rotary_dim=rotary_dim)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="fp8 rounding as the GPU does it")
def test_rotary_write_kv_rounds_into_fp8_cache() -> None:
    scales = (torch.tensor(0.05, device=DEVICE), torch.tensor(3.0, device=DEVICE))
    run_case(torch.bfloat16, FP8_DTYPE, 4, 16, scales, exact=False)


def test_fp8_write_saturates_at_448() -> None:
    positions = torch.zeros(1, dtype=torch.long, device=DEVICE)
    q = torch.zeros(1, 1, 16, device=DEVICE)
    k = torch.full((1, 1, 16), 1000.0, device=DEVICE)
    v = torch.linspace(-2000, 2000, 16, device=DEVICE).view(1, 1, 16)
    cos_sin_cache = torch.cat((torch.ones(1, 8), torch.zeros(1, 8)), dim=1).to(DEVICE)
    k_cache, v_cache = (torch.zeros(1, 4, 1, 16, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2))
    scales = (torch.tensor(1.0, device=DEVICE), torch.tensor(2.0, device=DEVICE))
    rotary_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                    torch.zeros(1, dtype=torch.long, device=DEVICE), scales)
    assert (k_cache[0, 0].float() == 448).all()
    stored = v_cache[0, 0, 0].float()
    assert stored.abs().max() == 448 and torch.equal(stored.sign(), v[0, 0].sign())


def run_case(dtype: torch.dtype, cache_dtype: torch.dtype, group: int, block_size: int,
             kv_scales: tuple[torch.Tensor, torch.Tensor] | None, exact: bool,
             head_dim: int = 64, rotary_dim: int | None = None) -> None:
    num_kv_heads, num_blocks = 2, 9
    rotary_dim = rotary_dim or head_dim
    num_heads = num_kv_heads * group
    # A chunk of sequence A at positions 5..13, a prompt B at 0..2, then two CUDA-graph padding
    # tokens; A and B on shuffled, non-contiguous blocks of the cache.
    block_ids = torch.randperm(num_blocks)
    tables = (block_ids[:4], block_ids[4:5])
    seqs = (torch.arange(5, 14), torch.arange(3))
    slots = [table[pos // block_size] * block_size + pos % block_size
             for table, pos in zip(tables, seqs)]
    positions = torch.cat([*seqs, torch.zeros(2, dtype=torch.long)]).to(DEVICE)
    slots = torch.cat([*slots, torch.full((2,), -1)]).to(DEVICE)
    num_tokens = len(positions)
    # q, k, v as column slices of the fused qkv projection, as the model passes them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    cos_sin_cache = torch.randn(20, rotary_dim, device=DEVICE)
    if exact:
        # Normal e4m3 values that stay normal divided by 2 or multiplied by 4.
        qkv = (qkv.sign() * qkv.abs().clamp(1 / 16, 8)).to(FP8_DTYPE).float()
        turns = torch.randint(0, 4, (20, rotary_dim // 2)) * torch.pi / 2
        cos_sin_cache = torch.cat((turns.cos(), turns.sin()), dim=1).round().to(DEVICE)
    qkv = qkv.to(dtype)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE).to(cache_dtype)
    v_cache = torch.full(shape, float("nan"), device=DEVICE).to(cache_dtype)
    ref_q, ref_k = rotary_ref(positions, q.float(), k.float(), cos_sin_cache)
    # The dims past the rotary ones pass through.
    assert torch.equal(ref_q[..., rotary_dim:], q[..., rotary_dim:].float())
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    write_kv_ref(ref_k, v, ref_k_cache, ref_v_cache, slots, kv_scales)
    v_before = v.clone()

    assert rotary_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slots,
                           kv_scales) is q

    assert_close(q, ref_q.to(dtype))
    assert_close(k, ref_k.to(dtype))
    assert torch.equal(v, v_before)
    written = slots[slots >= 0]
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    k_slots, v_slots = (c.view(-1, num_kv_heads, head_dim) for c in (k_cache, v_cache))
    ref_k_slots, ref_v_slots = (c.view(-1, num_kv_heads, head_dim)[written]
                                for c in (ref_k_cache, ref_v_cache))
    if cache_dtype == FP8_DTYPE:
        # fp32 rotation may round differently from torch's (fused multiply-adds): one e4m3 step.
        got, want = (dequantize(c, None) for c in (k_slots[written], ref_k_slots))
        assert ((got - want).abs() <= want.abs() / 8 + 1e-6).all()
        assert torch.equal(v_slots[written].view(torch.uint8), ref_v_slots.view(torch.uint8))
        if exact:
            assert torch.equal(k_slots[written].view(torch.uint8), ref_k_slots.view(torch.uint8))
    else:
        assert_close(k_slots[written], ref_k_slots)
        assert torch.equal(v_slots[written], ref_v_slots)
    assert k_slots[untouched].float().isnan().all() and v_slots[untouched].float().isnan().all()


@pytest.mark.parametrize("biased, rotary_dim", [(False, 32), (True, 32), (False, 24)],
                         ids=["unbiased", "biased", "partial-rotary"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_scales_by_a_folded_norm(dtype: torch.dtype, biased: bool, rotary_dim: int) -> None:
    """norm_of=(x, eps): q, k and v scaled by each token's 1 / RMS(x) first, v in place too (a
    prefill launch reads it there), padding tokens' included; the cache gets the scaled k, v.
    With bias (Qwen2's qkv bias kept out of the folded GEMM), each head's bias added after the
    scale. With partial rotary (Phi-4-mini), the unrotated dims scaled as well."""
    num_tokens, num_heads, num_kv_heads, head_dim, hidden, block_size = 6, 4, 2, 32, 96, 4
    eps = 1e-5
    positions = torch.tensor([3, 4, 5, 0, 1, 0], device=DEVICE)
    slots = torch.tensor([9, 10, 11, 0, 1, -1], device=DEVICE)
    x = (torch.randn(num_tokens, hidden, device=DEVICE) * torch.tensor([[0.1], [1], [30], [2], [5], [1]],
                                                                          device=DEVICE)).to(dtype)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    cos_sin_cache = torch.randn(8, rotary_dim, device=DEVICE)
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1) + eps)[:, None, None]
    sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    bias = tuple((torch.randn(size, device=DEVICE) * 3).to(dtype) for size in sizes) if biased else None
    q_bias, k_bias, v_bias = (b.float().view(-1, head_dim) for b in bias) if biased else (0.0, 0.0, 0.0)
    scaled_v = v.float() * inv + v_bias
    ref_q, ref_k = rotary_ref(positions, q.float() * inv + q_bias, k.float() * inv + k_bias, cos_sin_cache)
    shape = (3, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan"), device=DEVICE).to(dtype) for _ in range(2))
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    write_kv_ref(ref_k.to(dtype), scaled_v.to(dtype), ref_k_cache, ref_v_cache, slots)

    rotary_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slots, norm_of=(x, eps),
                    bias=bias)

    assert_close(q, ref_q.to(dtype))
    assert_close(k, ref_k.to(dtype))
    assert_close(v, scaled_v.to(dtype))
    written = slots[slots >= 0]
    for cache, ref in ((k_cache, ref_k_cache), (v_cache, ref_v_cache)):
        slots_of = cache.view(-1, num_kv_heads, head_dim)
        assert_close(slots_of[written], ref.view(-1, num_kv_heads, head_dim)[written])
    assert k_cache.view(-1, num_kv_heads, head_dim)[12:].float().isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("folded, head_dim", [(False, 32), (True, 32), (False, 24)],
                         ids=["qk-norm", "folded-qk-norm", "qk-norm-padded-head"])
def test_rotary_write_kv_norms_q_and_k_heads(dtype: torch.dtype, folded: bool, head_dim: int) -> None:
    """qk_norm=(q_weight, k_weight, eps): each q and k head RMS-normed (Qwen3's q_norm, k_norm)
    before it rotates; after a folded input norm's scale, where norm_of is given too."""
    num_tokens, num_heads, num_kv_heads, hidden, block_size, eps = 5, 4, 2, 64, 4, 1e-6
    positions = torch.tensor([3, 4, 5, 0, 0], device=DEVICE)
    slots = torch.tensor([9, 10, 11, 0, -1], device=DEVICE)
    x = (torch.randn(num_tokens, hidden, device=DEVICE) * 7).to(dtype)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    qkv = (qkv * torch.tensor([[0.01], [1], [20], [3], [1]], device=DEVICE)).to(dtype)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    q_weight, k_weight = (torch.rand(head_dim, device=DEVICE).to(dtype) + 0.5 for _ in range(2))
    cos_sin_cache = torch.randn(8, head_dim, device=DEVICE)
    inv = torch.rsqrt(x.float().pow(2).mean(-1) + eps)[:, None, None] if folded else 1.0
    ref_q, ref_k = rotary_ref(positions, rms_norm_ref(q.float() * inv, q_weight, eps)[0],
                              rms_norm_ref(k.float() * inv, k_weight, eps)[0], cos_sin_cache)
    shape = (3, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan"), device=DEVICE).to(dtype) for _ in range(2))

    rotary_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slots,
                    norm_of=(x, eps) if folded else None, qk_norm=(q_weight, k_weight, eps))

    assert_close(q, ref_q.to(dtype))
    assert_close(k, ref_k.to(dtype))
    written = slots[slots >= 0]
    assert_close(k_cache.view(-1, num_kv_heads, head_dim)[written], ref_k[:4].to(dtype))


@pytest.mark.parametrize("extra", [dict(bias=(torch.zeros(32), torch.zeros(16), torch.zeros(16))),
                                   dict(qk_norm=(torch.ones(16), torch.ones(16), 1e-6))],
                         ids=["bias", "qk-norm"])
def test_a_bias_or_qk_norm_needs_whole_heads_rotated(extra: dict) -> None:
    q, k, v = torch.zeros(1, 2, 16), torch.zeros(1, 1, 16), torch.zeros(1, 1, 16)
    cache = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="rotate whole"):
        rotary_write_kv(torch.zeros(1, dtype=torch.long), q, k, v, torch.zeros(4, 8), cache, cache.clone(),
                        torch.zeros(1, dtype=torch.long), norm_of=(torch.ones(1, 8), 1e-6), **extra)
