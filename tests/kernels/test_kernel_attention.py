import pytest
import torch

from tests.kernels.kernel_testing import (DEVICE, assert_close, poison_next_alloc, random_paged_kv, rel_err,
                            skip_bf16_dot_on_cpu)
from pagedserve.kernels import attention
from pagedserve.kernels.attention import MAX_SPLITS, AttentionConfig, choose_num_splits, paged_attention
from pagedserve.kernels.reference import FP8_DTYPE, paged_attention_ref, quantize_kv

NUM_KV_HEADS = 2
# (cached prefix, new queries): decodes, a short prompt, a long prompt, chunks continuing over a
# cached prefix (one ending mid-block, one past a whole tile), and a sequence with no queries.
MIXED = [(9, 1), (0, 5), (0, 70), (37, 1), (30, 41), (130, 19), (4, 0), (0, 1)]
DECODES = [(600, 1), (3, 1), (77, 1), (450, 1)]
# e4m3 keeps 3 mantissa bits: about 2-3% relative error on random K and V against attention
# over the unquantized cache.
FP8_TOLERANCE = 6e-2


def run_case(batch: list[tuple[int, int]], group: int, head_dim: int, block_size: int,
             dtype: torch.dtype, num_splits: int | None, strided: bool = False,
             max_query_len: int | None = None, config: AttentionConfig | None = None,
             q_gain: float = 1.0, kv_scales: tuple[float, float] | None = None,
             fresh: bool = False, poison_new: bool = False, decode_launch: bool = False,
             sliding_window: int | None = None, softcap: float | None = None) -> None:
    """Kernel against the reference on the same cache; with kv_scales, on an fp8 cache of
    K / k_scale and V / v_scale, and also against the reference on the unquantized cache; with
    fresh, given the new tokens' K and V as the step's k_new, v_new too; with poison_new, on a
    cache whose new tokens' slots hold NaN (the reference sees them); with decode_launch, told
    how many sequences are decode rows; with sliding_window, on a cache whose slots before each
    sequence's first query's window hold NaN (no query sees them: the kernel must not read
    them); softcap too."""
    seq_lens = [c + n for c, n in batch]
    query_lens = [n for _, n in batch]
    k_cache, v_cache, table = random_paged_kv(seq_lens, NUM_KV_HEADS, head_dim, block_size, dtype)
    exact_caches = k_cache, v_cache
    scales = None
    if kv_scales is not None:
        k_cache, v_cache = (c * s for c, s in zip(exact_caches, kv_scales))
        exact_caches = k_cache, v_cache
        scales = tuple(torch.tensor(s, device=DEVICE) for s in kv_scales)
        k_cache, v_cache = (quantize_kv(c, FP8_DTYPE, s) for c, s in zip(exact_caches, scales))
    k_new, v_new = ((new_token_rows(c, table, batch, block_size) for c in (k_cache, v_cache))
                    if fresh else (None, None))
    ref_caches = k_cache, v_cache
    if poison_new:
        # A decode launch reads a decode row's new key from the cache, where serving writes it
        # before attention: only the prefill chunks' slots are poisoned then.
        poisoned = [(c, 0 if decode_launch and n == 1 else n) for c, n in batch]
        k_cache, v_cache = (poison_slots(c, table, new_spans(poisoned), block_size)
                            for c in ref_caches)
    if sliding_window:
        unseen = [(0, max(0, cached - sliding_window + 1)) for cached, _ in batch]
        k_cache, v_cache = (poison_slots(c, table, unseen, block_size) for c in (k_cache, v_cache))
    num_heads, num_tokens = NUM_KV_HEADS * group, sum(query_lens)
    if strided:
        # q as the first columns of a fused qkv projection; k and v caches as halves of one
        # [num_blocks, 2, ...] allocation.
        qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, dtype=dtype,
                          device=DEVICE)
        q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        kv = torch.stack((k_cache, v_cache), dim=1)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=DEVICE)
    q *= q_gain
    starts = torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, k_cache, v_cache, table, lens, starts, scale,
                          max_query_len=max_query_len, max_seq_len=max(seq_lens),
                          num_splits=num_splits, out=out, kv_scales=scales, config=config,
                          k_new=k_new, v_new=v_new,
                          num_decode_seqs=query_lens.count(1) if decode_launch else 0,
                          sliding_window=sliding_window, softcap=softcap)
    assert got is out
    ref = paged_attention_ref(q, *ref_caches, table, lens, starts, scale, scales, sliding_window,
                              softcap)
    assert_close(out, ref)
    if softcap:
        # The cap bends these scores enough for a kernel that ignored it to fail.
        uncapped = paged_attention_ref(q, *ref_caches, table, lens, starts, scale, scales,
                                       sliding_window)
        assert rel_err(uncapped, ref) > 0.05
    if kv_scales is not None and not softcap:
        # (Capped cases are sharp: their fp8 error reaches the tolerance in 1 draw of ~200.)
        exact = paged_attention_ref(q, *exact_caches, table, lens, starts, scale,
                                    sliding_window=sliding_window)
        assert rel_err(out, exact) < FP8_TOLERANCE


def token_slots(table: torch.Tensor, spans: list[tuple[int, int]],
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) in the cache of positions [lo, hi) of each sequence, in sequence order."""
    blocks, offsets = [], []
    for i, (lo, hi) in enumerate(spans):
        pos = torch.arange(lo, hi, device=DEVICE)
        blocks.append(table[i, pos // block_size].long())
        offsets.append(pos % block_size)
    return torch.cat(blocks), torch.cat(offsets)


def new_token_rows(cache: torch.Tensor, table: torch.Tensor, batch: list[tuple[int, int]],
                   block_size: int) -> torch.Tensor:
    """The cache entries of each sequence's new tokens, packed as the step's k or v."""
    return cache[token_slots(table, new_spans(batch), block_size)]


def new_spans(batch: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The positions of each sequence's new tokens."""
    return [(cached, cached + n) for cached, n in batch]


def poison_slots(cache: torch.Tensor, table: torch.Tensor, spans: list[tuple[int, int]],
                 block_size: int) -> torch.Tensor:
    """A copy of cache whose positions [lo, hi) of each sequence hold NaN."""
    poisoned = cache.clone()
    poisoned[token_slots(table, spans, block_size)] = float("nan")
    return poisoned


@pytest.mark.parametrize("num_splits", [1, 4], ids=["unsplit", "split4"])
@pytest.mark.parametrize("group,head_dim,block_size,dtype", [
    (1, 32, 4, torch.float32),
    (4, 64, 16, torch.float16),
    (8, 16, 256, torch.float32),
    (4, 128, 16, torch.bfloat16),
])
def test_mixed_batch(group: int, head_dim: int, block_size: int, dtype: torch.dtype,
                     num_splits: int) -> None:
    skip_bf16_dot_on_cpu(dtype)
    run_case(MIXED, group, head_dim, block_size, dtype, num_splits)


# Prefill tilings the benchmark sweeps: reverse order, 128-token KV tiles, 64-row tiles, the
# lazy rescale, on sharp scores (q x 6) whose running max grows past 2^8 in some tiles only, and
# keys loaded transposed (the decode tiling's) under a causal diagonal, in spans or in one loop.
@pytest.mark.parametrize("config", [
    AttentionConfig(128, 64, 8, 3, reverse=False),
    AttentionConfig(64, 32, 4, 2, k_transposed=True),
    AttentionConfig(16, 32, 4, 2, k_transposed=True, one_loop=True),
    AttentionConfig(128, 128, 8, 3, reverse=True),
    AttentionConfig(64, 32, 4, 2, reverse=True, lazy_rescale=True),
    AttentionConfig(128, 16, 8, 3, lazy_rescale=True),
], ids=str)
def test_prefill_configs(config: AttentionConfig) -> None:
    run_case(MIXED, 4, 32, 8, torch.float32, num_splits=1, config=config, q_gain=6.0)


# New keys through tensor descriptors: 64-token tiles (one diagonal tile per q block) and
# 16-token tiles (several, behind a cached context of partial tiles), then a split launch, which
# reads the paged cache alone.
@pytest.mark.parametrize("config, num_splits", [
    (AttentionConfig(128, 64, 8, 3, reverse=True, fresh_kv=True), 1),
    (AttentionConfig(64, 16, 4, 2, lazy_rescale=True, fresh_kv=True), 1),
    (AttentionConfig(128, 64, 8, 3, fresh_kv=True), 4),
], ids=str)
def test_fresh_kv_from_the_step(config: AttentionConfig, num_splits: int) -> None:
    run_case(MIXED, 4, 32, 8, torch.float32, num_splits=num_splits, config=config, q_gain=6.0,
             fresh=True, poison_new=num_splits == 1)


@pytest.fixture
def large_step_tilings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles and launches as a step of more than MEDIUM_STEP_TOKENS tokens gets them, at this
    test's few tokens."""
    monkeypatch.setattr(attention, "SMALL_STEP_TOKENS", 0)
    monkeypatch.setattr(attention, "MEDIUM_STEP_TOKENS", 0)


# The default prefill tiling given k_new (128-token KV tiles): chunks after cached prefixes
# longer than themselves (a whole tile and a partial one; a block of 16-token pages), a decode
# row, and a prompt past one KV tile. The new tokens' cache slots hold NaN, so only a kernel
# that reads them from k_new / v_new and the prefixes from the paged cache passes.
@pytest.mark.usefixtures("large_step_tilings")
def test_default_prefill_reads_chunks_over_a_cached_prefix() -> None:
    run_case([(150, 40), (260, 3), (9, 1), (0, 200)], 4, 32, 16, torch.float32,
             num_splits=None, fresh=True, poison_new=True)


@pytest.mark.parametrize("batch, max_query_len, num_splits", [
    (MIXED, None, 1), (MIXED, None, 4), (DECODES, 1, 1), (DECODES, 1, 4)],
    ids=["prefill", "prefill-split4", "decode", "decode-split4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache(batch: list[tuple[int, int]], max_query_len: int | None, num_splits: int,
                   dtype: torch.dtype) -> None:
    skip_bf16_dot_on_cpu(dtype)
    # Given k_new as serving gives it, an fp8 cache still reads the paged cache alone.
    run_case(batch, 4, 64, 16, dtype, num_splits, max_query_len=max_query_len,
             kv_scales=(0.02, 3.0), fresh=True)


# Sliding windows (Mistral, Qwen2, Gemma 2 / 3) and logit soft-capping (Gemma 2) over MIXED's
# chunked prefills and decodes, on 16-token KV tiles and 8-token blocks: a window below one
# block, capped (q x 6 makes scores of ~+-25 that a cap of 4 bends), and one spanning tiles and
# above some contexts, with the new keys read from the step's k / v (their cache slots poisoned).
@pytest.mark.parametrize("window, softcap, config", [
    (5, 4.0, AttentionConfig(64, 16, 4, 2, reverse=True)),
    (40, None, AttentionConfig(64, 16, 4, 2, lazy_rescale=True, fresh_kv=True)),
], ids=["w5-softcap", "w40-fresh"])
def test_sliding_window_prefill(window: int, softcap: float | None,
                                config: AttentionConfig) -> None:
    run_case(MIXED, 4, 32, 8, torch.float32, 1, config=config, q_gain=6.0, fresh=config.fresh_kv,
             poison_new=config.fresh_kv, sliding_window=window, softcap=softcap)


# Phi-3-mini's head_dim of 96, padded to 128 in the tiles: a chunk over a cached prefix and a
# decode row unsplit, given the step's k / v (tensor descriptors take whole power-of-two heads,
# so the kernel reads the cache), and decode rows split 2 ways (the merge's padded partials).
@pytest.mark.parametrize("batch, max_query_len, num_splits", [
    ([(30, 41), (9, 1)], None, 1), ([(600, 1), (3, 1)], 1, 2)],
                         ids=["prefill", "decode-split2"])
def test_head_dim_not_a_power_of_two(batch: list[tuple[int, int]], max_query_len: int | None,
                                     num_splits: int) -> None:
    run_case(batch, 1, 96, 8, torch.float32, num_splits, max_query_len=max_query_len, fresh=True)


# Decode rows over contexts of 3 to 600 keys under a 100-key window, soft-capped: split 4 ways
# (the segments share the tiles of the window, not those of the context) in fp16, and unsplit
# over an fp8 cache (its K scale of 4 goes inside the cap's tanh).
@pytest.mark.parametrize("num_splits, kv_scales", [(4, None), (1, (4.0, 0.5))],
                         ids=["split4", "fp8-cache"])
def test_sliding_window_decode(num_splits: int, kv_scales: tuple[float, float] | None) -> None:
    run_case(DECODES, 4, 64, 16, torch.float16, num_splits, max_query_len=1, q_gain=6.0,
             kv_scales=kv_scales, sliding_window=100, softcap=5.0)


class LaunchSpy:
    """Records the grid of each _attention_kernel launch, then launches it."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


# A mixed step told its decode rows attends them in a second launch of the decode tiling, one
# program per sequence, while the prefill launch skips them: over a bf16-like or an fp8 cache,
# with the step's new keys read from k_new (their cache slots poisoned) where the cache allows.
# The prefill launch, which searches for its sequences, puts the KV heads first in its grid.
@pytest.mark.usefixtures("large_step_tilings")
@pytest.mark.parametrize("kv_scales", [None, (0.02, 3.0)], ids=["cache", "fp8-cache"])
def test_mixed_step_attends_decode_rows_in_a_launch_of_their_own(
        monkeypatch: pytest.MonkeyPatch, kv_scales: tuple[float, float] | None) -> None:
    spy = LaunchSpy(attention._attention_kernel)
    monkeypatch.setattr(attention, "_attention_kernel", spy)
    run_case(MIXED, 4, 64, 16, torch.float32, num_splits=None, kv_scales=kv_scales, fresh=True,
             poison_new=kv_scales is None, decode_launch=True)
    assert len(spy.grids) == 2 and spy.grids[0][0] == NUM_KV_HEADS and spy.grids[1][0] == len(MIXED)


# The same under a 24-key window: both launches skip the tiles before each query's window.
@pytest.mark.usefixtures("large_step_tilings")
def test_sliding_window_mixed_step_decode_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = LaunchSpy(attention._attention_kernel)
    monkeypatch.setattr(attention, "_attention_kernel", spy)
    run_case(MIXED, 4, 32, 8, torch.float32, num_splits=None, fresh=True, poison_new=True,
             decode_launch=True, sliding_window=24, q_gain=3.0)
    assert len(spy.grids) == 2


# A decode step (max_query_len 1) attends in one launch of one program per sequence, split or not.
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_step_launches_one_program_per_sequence(monkeypatch: pytest.MonkeyPatch,
                                                       num_splits: int) -> None:
    spy = LaunchSpy(attention._attention_kernel)
    monkeypatch.setattr(attention, "_attention_kernel", spy)
    run_case(DECODES, 4, 32, 16, torch.float32, num_splits, max_query_len=1)
    assert [grid[0] for grid in spy.grids] == [len(DECODES)]


# Programs find their sequence among more sequences than one load of the search covers (128),
# empty ones and prompt chunks among them, as a mixed graph's 257 sequences are.
def test_programs_find_their_sequence_among_many() -> None:
    batch = [(i % 5, (0, 1, 3, 1)[i % 4]) for i in range(140)] + [(2, 6)]
    run_case(batch, 2, 16, 8, torch.float32, num_splits=1)


# A step of few tokens, told its decode rows and given k_new as serving gives them, attends all
# its rows in one launch of small tiles that read the cache: 16-row tiles at MIXED's 138 tokens,
# 64-row tiles past SMALL_STEP_TOKENS (lowered to 100 here), under a window and a cap too.
@pytest.mark.parametrize("small_step_tokens, block_m", [(256, 16), (100, 64)])
@pytest.mark.parametrize("window, softcap", [(None, None), (24, 4.0)], ids=["full", "w24-softcap"])
def test_small_step_attends_in_one_launch_of_small_tiles(
        monkeypatch: pytest.MonkeyPatch, small_step_tokens: int, block_m: int, window: int | None,
        softcap: float | None) -> None:
    monkeypatch.setattr(attention, "SMALL_STEP_TOKENS", small_step_tokens)
    configs = []
    default_config = attention.default_config
    monkeypatch.setattr(attention, "default_config",
                        lambda *a, **kw: configs.append(default_config(*a, **kw)) or configs[-1])
    spy = LaunchSpy(attention._attention_kernel)
    monkeypatch.setattr(attention, "_attention_kernel", spy)
    run_case(MIXED, 4, 32, 8, torch.float32, num_splits=None, fresh=True, decode_launch=True,
             sliding_window=window, softcap=softcap, q_gain=3.0)
    assert len(spy.grids) == 1 and [c.block_m for c in configs] == [block_m]


def test_strided_q_and_cache_views() -> None:
    run_case(MIXED, 4, 32, 8, torch.float32, num_splits=2, strided=True)


def test_split_counts_off_the_powers_of_two_merge_whole() -> None:
    # The split count is a run-time value: the merge masks its unused partial slots.
    run_case(MIXED, 4, 32, 8, torch.float32, num_splits=3)


def test_too_many_splits_is_refused() -> None:
    k_cache, v_cache, table = random_paged_kv([4], NUM_KV_HEADS, 32, 16, torch.float32)
    q = torch.randn(1, 4 * NUM_KV_HEADS, 32, device=DEVICE)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="num_splits must be 1 to 16"):
        paged_attention(q, k_cache, v_cache, table, lens, starts, 0.2, num_splits=MAX_SPLITS + 1)


def test_decode_batch_picks_split_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = []

    def spy(*args: int, **kwargs: int) -> int:
        chosen.append(choose_num_splits(*args, **kwargs))
        return chosen[-1]

    # The heuristic sees an H100/H200-sized GPU, whatever runs the test.
    monkeypatch.setattr(attention, "_num_sms", lambda device: 132)
    monkeypatch.setattr(attention, "choose_num_splits", spy)
    batch = [(n, 1) for n in (600, 3, 77, 450)]
    poison_next_alloc((len(batch), 4 * NUM_KV_HEADS, 32), torch.float32)
    seq_lens = [c + 1 for c, _ in batch]
    k_cache, v_cache, table = random_paged_kv(seq_lens, NUM_KV_HEADS, 32, 16, torch.float32)
    q = torch.randn(len(batch), 4 * NUM_KV_HEADS, 32, device=DEVICE)
    starts = torch.arange(len(batch) + 1, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    got = paged_attention(q, k_cache, v_cache, table, lens, starts, 0.2, max_query_len=1)
    # 16 KiB tiles of float32 head_dim 32 hold 128 tokens: 601 keys keep 2 tiles per segment
    # in 2 segments.
    assert chosen == [2]
    assert_close(got, paged_attention_ref(q, k_cache, v_cache, table, lens, starts, 0.2))


def test_split_heuristic() -> None:
    # 256 decodes x 8 KV heads fill 132 multiprocessors: no split.
    assert choose_num_splits(256, 8, 4096, 64, num_sms=132) == 1
    # 4 decodes x 8 KV heads: split up to about 4 programs per multiprocessor.
    assert choose_num_splits(4, 8, 32768, 64, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(16, 8, 32768, 64, num_sms=132) == 8
    # Short contexts keep at least 2 KV tiles per segment.
    assert choose_num_splits(4, 8, 256, 64, num_sms=132) == 2
    assert choose_num_splits(4, 8, 64, 64, num_sms=132) == 1


@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "other"])
def test_large_fp8_decode_launches_pipeline_deeper_on_hopper_only(monkeypatch: pytest.MonkeyPatch,
                                                                   hopper: bool) -> None:
    monkeypatch.setattr(attention, "_hopper", lambda device: hopper)

    def stages(rows: int, kv_bytes: int) -> int:
        return attention.default_config(8, 128, 2, 1, kv_bytes=kv_bytes, num_tokens=rows,
                                        device=torch.device("cuda")).num_stages

    assert [stages(rows, 1) for rows in (16, 255, 256, 512)] == [3, 3] + [5 if hopper else 3] * 2
    assert [stages(rows, 2) for rows in (16, 512)] == [2, 2]
