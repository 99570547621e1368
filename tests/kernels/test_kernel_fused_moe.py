"""fused_moe, its routing and its alignment against the torch references, and the reference against
the plain per-token definition. Tiny hidden and intermediate sizes keep the interpreter quick."""
import pytest
import torch
import triton

from tests.kernels.kernel_testing import DEVICE, assert_close, poison_next_alloc, rel_err
from pagedserve.kernels.fused_moe import fused_moe, quantize_experts_fp8
from pagedserve.kernels.moe_config import (GEMV_MAX_TOKENS, SMEM_BUDGET, AnyMoeConfig, MoeConfig,
                                           MoeGemmConfig, MoeGemvConfig, SmallBatchMoeConfig,
                                           default_config, default_gemv_config, min_block_k,
                                           moe_config, stage_bytes)
from pagedserve.kernels.moe_routing import SINGLE_PROGRAM_SLOTS, MoeAlignment, moe_align, route
from pagedserve.kernels.reference import fused_moe_ref, quantize_experts_fp8_ref, route_ref

HIDDEN, INTER = 32, 24


def random_experts(num_experts: int, dtype: torch.dtype, hidden: int = HIDDEN,
                   inter: int = INTER) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, device=DEVICE) * inter ** -0.5
    return w13.to(dtype), w2.to(dtype)


def routed(num_tokens: int, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing as `route` gives it (int32 ids), through the reference: the interpreter
    runs `route` a token at a time."""
    logits = torch.randn(num_tokens, num_experts, device=DEVICE) * 2
    weights, ids = route_ref(logits, top_k, renormalize=True)
    return weights, ids.to(torch.int32)


def dense_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """The definition, one token and one chosen expert at a time, in float64."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, j]) * (w2[e].double() @ act)
    return out


def test_reference_matches_the_per_token_definition() -> None:
    x = torch.randn(6, HIDDEN)
    w13, w2 = (w.cpu() for w in random_experts(8, torch.float32))
    weights, ids = route_ref(torch.randn(6, 8), 3, renormalize=False)
    out = fused_moe_ref(x, w13, w2, weights, ids)
    assert rel_err(out, dense_moe(x, w13, w2, weights, ids)) < 1e-6


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (60, 4), (128, 8)])
def test_route_matches_softmax_then_topk(num_experts: int, top_k: int, renormalize: bool) -> None:
    logits = (torch.randn(7, num_experts, device=DEVICE) * 3).to(torch.bfloat16)
    weights, ids = route(logits, top_k, renormalize)
    torch.testing.assert_close(weights, route_ref(logits, top_k, renormalize)[0])
    # Distinct experts with the top probabilities, largest first; bf16 logits tie, and a tie
    # may go either way.
    assert ids.dtype == torch.int32 and (ids.sort(dim=1).values.diff(dim=1) > 0).all()
    probs = torch.softmax(logits.float(), dim=-1)
    torch.testing.assert_close(probs.gather(1, ids.long()), probs.topk(top_k).values)


def test_renormalized_routing_is_a_softmax_over_the_top_logits() -> None:
    # Mixtral's formulation: top-k of the logits, then a softmax over those alone.
    logits = torch.randn(5, 8, device=DEVICE)
    weights, ids = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids.long()), dim=-1))


def check_alignment(alignment: MoeAlignment, topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> None:
    ids = topk_ids.flatten().long().cpu()
    num_slots = ids.numel()
    assert alignment.sorted_ids.numel() == num_slots + num_experts * (block_m - 1)
    padded = alignment.num_padded.item()
    counts = torch.bincount(ids, minlength=num_experts)
    assert padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    entries = alignment.sorted_ids[:padded].long().cpu()
    real = entries < num_slots
    assert (entries[~real] == num_slots).all(), "padding is marked with num_slots"
    assert torch.equal(entries[real].sort().values, torch.arange(num_slots)), "every slot once"
    blocks = alignment.expert_ids[:padded // block_m].long().cpu()
    assert alignment.max_blocks >= blocks.numel()
    assert torch.equal(ids[entries[real]], blocks.repeat_interleave(block_m)[real]), "one expert a block"
    assert (blocks[1:] > blocks[:-1]).sum() == (counts > 0).sum() - 1, "experts in order, no empty block"
    assert real.view(-1, block_m).any(dim=1).all()


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m", [
    (1, 8, 128, 16), (5, 2, 8, 16), (33, 4, 60, 32),
    # Past SINGLE_PROGRAM_SLOTS: the second, many-program placement launch.
    (SINGLE_PROGRAM_SLOTS // 4 + 3, 8, 16, 64)])
def test_moe_align_invariants(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> None:
    _, ids = routed(num_tokens, num_experts, top_k)
    check_alignment(moe_align(ids, num_experts, block_m), ids, num_experts, block_m)


def test_moe_align_of_a_skewed_batch() -> None:
    # Every token's first choice is expert 2: a run of many blocks, most experts empty.
    ids = torch.stack([torch.full((40,), 2), torch.randint(3, 8, (40,))], dim=1).to(DEVICE)
    check_alignment(moe_align(ids, 8, 16), ids, 8, 16)


def grouped(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype) -> MoeConfig:
    """The grouped GEMMs' heuristic tiling, which `moe_config` replaces by the small-batch path
    at small M."""
    return default_config(num_tokens, num_experts, HIDDEN, INTER, top_k, dtype, dtype)


def run_and_compare(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, config: AnyMoeConfig, **scales: torch.Tensor) -> None:
    num_tokens, top_k = ids.shape
    inter = w2.shape[2]
    # Every buffer the paths allocate: slot rows of both widths, the output.
    for shape in ((num_tokens * top_k, x.shape[1]), (num_tokens * top_k, inter), (num_tokens, x.shape[1])):
        poison_next_alloc(shape, x.dtype)
    out = fused_moe(x, w13, w2, weights, ids, config=config, **scales)
    # The small-batch path reads FP8 experts W8A16.
    small = isinstance(config, SmallBatchMoeConfig)
    w8a8 = (False, False) if small else (config.gate_up.w8a8, config.down.w8a8)
    ref = fused_moe_ref(x, w13, w2, weights, ids, scales.get("w13_scale"), scales.get("w2_scale"), *w8a8)
    # Gate/up then down: two products (float32 on an H200 measured 2.08e-3 against one's 2e-3).
    assert_close(out, ref, products=2)


# Batch 1 over 128 experts (120 chosen by no token), a few tokens, one more than a 16-row block.
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 128, 8), (3, 8, 2), (17, 16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_reference(num_tokens: int, num_experts: int, top_k: int,
                                     dtype: torch.dtype) -> None:
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE).to(dtype)
    w13, w2 = random_experts(num_experts, dtype)
    run_and_compare(x, w13, w2, *routed(num_tokens, num_experts, top_k),
                    grouped(num_tokens, num_experts, top_k, dtype))


# I = 24 in 16-column tiles (the second partial), H = 48 in 32-row tiles (likewise), 16-deep steps;
# 64-deep steps past H and I (masked), 2 and 4 rows a program. Top-k 3 pads the down GEMV's expert
# lanes to 4.
SMALL_TILINGS = [SmallBatchMoeConfig(MoeGemvConfig(16, 16), MoeGemvConfig(32, 16)),
                 SmallBatchMoeConfig(MoeGemvConfig(2, 64, 2), MoeGemvConfig(4, 64, 2))]


@pytest.mark.parametrize("config", SMALL_TILINGS)
@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden",
                         [(1, 128, 8, HIDDEN), (2, 8, 1, HIDDEN), (3, 16, 2, 48), (4, 8, 3, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_batch_path_matches_reference(num_tokens: int, num_experts: int, top_k: int, hidden: int,
                                            dtype: torch.dtype, config: SmallBatchMoeConfig) -> None:
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    w13, w2 = random_experts(num_experts, dtype, hidden)
    run_and_compare(x, w13, w2, *routed(num_tokens, num_experts, top_k), config)


@pytest.mark.parametrize("config", SMALL_TILINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_batch_path_fp8_experts(dtype: torch.dtype, config: SmallBatchMoeConfig) -> None:
    num_tokens, num_experts, top_k = 2, 128, 8
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE).to(dtype)
    w13, w2 = random_experts(num_experts, torch.float32)
    (w13, w13_scale), (w2, w2_scale) = quantize_experts_fp8_ref(w13), quantize_experts_fp8_ref(w2)
    run_and_compare(x, w13, w2, *routed(num_tokens, num_experts, top_k), config,
                    w13_scale=w13_scale, w2_scale=w2_scale)


@pytest.mark.parametrize("num_tokens", [1, GEMV_MAX_TOKENS])
def test_fused_moe_takes_the_small_batch_path_at_small_m(num_tokens: int) -> None:
    num_experts, top_k, dtype = 16, 2, torch.bfloat16
    picked = moe_config(num_tokens, num_experts, HIDDEN, INTER, top_k, dtype, dtype)
    assert picked == default_gemv_config(HIDDEN, INTER, dtype)
    assert isinstance(moe_config(num_tokens + GEMV_MAX_TOKENS, num_experts, HIDDEN, INTER, top_k,
                                 dtype, dtype), MoeConfig)
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE).to(dtype)
    w13, w2 = random_experts(num_experts, dtype)
    weights, ids = routed(num_tokens, num_experts, top_k)
    out = fused_moe(x, w13, w2, weights, ids)
    assert_close(out, fused_moe(x, w13, w2, weights, ids, config=grouped(num_tokens, num_experts,
                                                                         top_k, dtype)), products=2)


def test_fused_moe_with_tiles_off_the_shape() -> None:
    # I = 24 in 16-column tiles and 16-deep steps (the second of each partial), row blocks grouped.
    tiling = MoeGemmConfig(block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=2)
    x = torch.randn(9, HIDDEN, device=DEVICE)
    w13, w2 = random_experts(4, torch.float32)
    run_and_compare(x, w13, w2, *routed(9, 4, 2), config=MoeConfig(16, tiling, tiling))


def test_quantize_experts_matches_reference() -> None:
    w = torch.randn(3, 5, 48, device=DEVICE) * torch.rand(3, 5, 1, device=DEVICE)
    q, scale = quantize_experts_fp8(w)
    ref_q, ref_scale = quantize_experts_fp8_ref(w)
    assert q.shape == w.shape and scale.shape == (3, 5, 1)
    assert torch.equal(q.float(), ref_q.float()) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("w8a8", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_fp8_experts(w8a8: bool, dtype: torch.dtype) -> None:
    num_tokens, num_experts, top_k = 5, 16, 4
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE).to(dtype)
    w13, w2 = random_experts(num_experts, torch.float32)
    (w13, w13_scale), (w2, w2_scale) = quantize_experts_fp8_ref(w13), quantize_experts_fp8_ref(w2)
    cfg = default_config(num_tokens, num_experts, HIDDEN, INTER, top_k, w13.dtype, dtype)
    tiling = MoeGemmConfig(32, 32, w8a8=w8a8)
    run_and_compare(x, w13, w2, *routed(num_tokens, num_experts, top_k),
                    MoeConfig(cfg.block_m, tiling, tiling), w13_scale=w13_scale, w2_scale=w2_scale)


def test_no_tokens_gives_an_empty_output() -> None:
    w13, w2 = random_experts(4, torch.float32)
    weights, ids = routed(0, 4, 2)
    assert fused_moe(torch.empty(0, HIDDEN, device=DEVICE), w13, w2, weights, ids).shape == (0, HIDDEN)


def test_tuned_entry_of_the_largest_measured_m_at_or_below() -> None:
    gemv = SmallBatchMoeConfig(MoeGemvConfig(8, 512), MoeGemvConfig(4, 256))
    small = MoeConfig(16, MoeGemmConfig(32, 64), MoeGemmConfig(64, 64))
    large = MoeConfig(64, MoeGemmConfig(64, 64), MoeGemmConfig(128, 64))
    table = {(8, HIDDEN, INTER, 2, "bfloat16"): {2: gemv, 4: small, 64: large}}
    shape = (8, HIDDEN, INTER, 2, torch.bfloat16, torch.bfloat16)
    assert [moe_config(m, *shape, table=table) for m in (1, 3, 4, 63, 64, 5000)] == [
        gemv, gemv, small, small, large, large]
    # A shape not in the table: the heuristics.
    untuned = (8, HIDDEN, INTER, 4, torch.bfloat16, torch.bfloat16)
    above = GEMV_MAX_TOKENS + 1
    assert moe_config(above, *untuned, table=table) == default_config(above, *untuned)


@pytest.mark.parametrize("num_tokens", [1, 64, 512, 8192])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_default_config_fits_the_shape_and_shared_memory(num_tokens: int, weight_dtype: torch.dtype) -> None:
    act_dtype = torch.float32 if weight_dtype == torch.float32 else torch.bfloat16
    for hidden, inter in ((2048, 768), (2048, 384), (HIDDEN, INTER)):
        cfg = default_config(num_tokens, 128, hidden, inter, 8, weight_dtype, act_dtype)
        for tiling, n, k, gated in ((cfg.gate_up, inter, hidden, True), (cfg.down, hidden, inter, False)):
            a_bytes = 1 if tiling.w8a8 and weight_dtype.itemsize == 1 else act_dtype.itemsize
            assert 16 <= tiling.block_n <= max(16, triton.next_power_of_2(n))
            floor_k = min_block_k(a_bytes)
            assert floor_k <= tiling.block_k <= max(floor_k, triton.next_power_of_2(k))
            smem = stage_bytes(tiling, cfg.block_m, a_bytes, weight_dtype.itemsize, gated)
            assert tiling.num_stages * smem <= SMEM_BUDGET


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_default_gemv_config_fits_the_shape(weight_dtype: torch.dtype) -> None:
    for hidden, inter in ((2048, 768), (4096, 14336), (HIDDEN, INTER)):
        cfg = default_gemv_config(hidden, inter, weight_dtype)
        for tiling, n, k in ((cfg.gate_up, inter, hidden), (cfg.down, hidden, inter)):
            assert tiling.block_n <= triton.next_power_of_2(n) and tiling.block_k <= triton.next_power_of_2(k)
            assert tiling.block_k * weight_dtype.itemsize <= 1024
