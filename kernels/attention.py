"""Unified paged attention: one launch for a mixed batch of prefill chunks and decode rows.

A program owns a tile of query positions x the query heads that share one KV head (GQA packing),
so each KV tile is read once per tile of queries and both products run on tensor cores. The
split-KV (flash-decoding) path runs the same kernel with a third grid axis over KV segments and
merges the segments' partial results in a second, small kernel. An fp8 KV cache is widened
to the query dtype as it is loaded (see kernels/reference.py for its scales).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedserve.kernels import pdl
from pagedserve.kernels.activation import tanh
from pagedserve.kernels.quant import INTERPRETED
from pagedserve.kernels.reference import is_fp8

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
# Which sequences a launch attends for (its run-time `rows` argument): all, those with more than
# one query (prefill chunks), or those with one (decode rows, one program per sequence).
ALL_ROWS, PREFILL_ROWS, DECODE_ROWS = 0, 1, 2
# A launch of few queries (a decode batch beside a prompt chunk or two, as mixed-step CUDA graphs
# run it) attends every row in one launch of small tiles, 16 rows up to SMALL_STEP_TOKENS and 64
# up to MEDIUM_STEP_TOKENS: prompt chunks then spread over many programs rather than a few that
# each walk the whole context, and the decode rows need no launch of their own. On an H200
# (Llama-3.1-8B shape, a layer padded as mixed graphs pad it, 2026-12-02) 42 decode rows of 530
# keys plus a 32-token chunk over 300 cached took 32.5 us against 55.5 in the prefill tiling and
# a decode launch (the decode rows alone: 32.2); plus 200 prompt tokens 40.5 against 62.6; 4 x
# 120 prompt tokens 18.9 against 36.4 (64-row tiles); 448 prompt tokens over 3,000 cached 146.7
# against 143.0, where 16-row tiles took 259.5, rereading the context for every 4 queries.
SMALL_STEP_TOKENS = 256
MEDIUM_STEP_TOKENS = 512


def small_step(num_tokens: int | None) -> bool:
    """Whether a launch of num_tokens queries (None: as many as a prefill tiling suits) attends all
    its rows in one launch of small tiles."""
    return num_tokens is not None and num_tokens <= MEDIUM_STEP_TOKENS
_ALL_ROWS, _DECODE_ROWS = tl.constexpr(ALL_ROWS), tl.constexpr(DECODE_ROWS)
# The interpreter runs no inline PTX.
_PTX_WIDEN = tl.constexpr(not INTERPRETED)


@triton.jit
def _find_seq(query_start_loc, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence i owns q blocks [start_i // BLOCK_Q + i, end_i // BLOCK_Q + i], an upper bound
    # that lets the host size the grid without reading query_start_loc. First blocks grow with
    # i, so the block's sequence is the count of those at most q_block, less one: counted 128 at
    # a time, one load each, where a bisection waited on up to 9 dependent loads (a mixed graph's
    # 257 sequences). On an H200 a 512-token mixed graph's layer took 78.2 us against 79.5.
    SEARCH: tl.constexpr = 128
    offs = tl.arange(0, SEARCH)
    count = 0
    for base in range(0, num_seqs, SEARCH):
        i = base + offs
        ok = i < num_seqs
        first = tl.load(query_start_loc + i, mask=ok, other=0) // BLOCK_Q + i
        count += tl.sum(((first <= q_block) & ok).to(tl.int32), 0)
    return count - 1


@triton.jit
def _softmax_step(acc, l_i, m_i, q, k, v, visible, qk_scale, cap, MASKED: tl.constexpr,
                  LAZY_RESCALE: tl.constexpr, K_T: tl.constexpr, SOFTCAP: tl.constexpr):
    """One KV tile of the online softmax; `visible` [rows, TILE] masks scores when MASKED; k is
    [HEAD_PAD, TILE] when K_T, else [TILE, HEAD_PAD]. With SOFTCAP, qk_scale is scale / softcap
    and cap softcap * log2(e)."""
    # An fp8 cache widens to the query dtype here; its K scale is folded into qk_scale and its
    # V scale applied to the output. V read as int16 pairs (V_PAIRS in _attention_kernel) keeps
    # acc as a pair.
    PAIRS: tl.constexpr = v.dtype == tl.int16
    if K_T:
        s = tl.dot(q, k.to(q.dtype))
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    if SOFTCAP:
        # Capped scores are scaled already (to log2 units): the steps below scale by 1.
        s = tanh(s * qk_scale) * cap
        qk_scale = 1.0
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    # Scores stay unscaled so that scaling and the max subtraction fuse into one FMA.
    m_tile = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if LAZY_RESCALE:
        # FlashAttention-4's conditional rescaling: keep a stale max unless a row's grows by
        # more than 8 (p then stays below 2^8), and skip the rescale when no row's does.
        grow = m_tile > m_i + 8.0
        m_new = tl.where(grow, m_tile, m_i)
    else:
        m_new = m_tile
    if MASKED:
        # A row can see no key of a tile (or a whole segment): keep exp2 off -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    if LAZY_RESCALE:
        if tl.max(grow.to(tl.int32), 0) > 0:
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha
            acc = _rescaled(acc, alpha, PAIRS)
    else:
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha
        acc = _rescaled(acc, alpha, PAIRS)
    l_i = l_i + tl.sum(p, 1)
    if PAIRS:
        low, high = _widen_pairs(v)
        acc = (tl.dot(p.to(q.dtype), low, acc[0]), tl.dot(p.to(q.dtype), high, acc[1]))
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
    return acc, l_i, m_new


@triton.jit
def _widen_pairs(v):
    """v: int16, each element two E4M3 values (its low byte the even head dim): the even and the
    odd ones as fp16, each v's shape."""
    if _PTX_WIDEN:
        # Two pairs a register: one byte permute and a conversion per half, where the bit
        # operations below add a mask, a shift and more permutes (the sm_90 decode kernel's loop
        # over a 128-token tile: 1,051 -> 826 instructions split, 967 -> 742 unsplit). On an
        # H100 (Llama-3.1-8B shape, 2026-12-06), bitwise the same outputs in 0.92-0.97 of the
        # time in decode graphs of 10-42 rows and 0.985 at 512 rows (BENCHMARKS.md).
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [v], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    low = (v & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    high = ((v >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return low, high


@triton.jit
def _rescaled(acc, alpha, PAIRS: tl.constexpr):
    if PAIRS:
        acc = (acc[0] * alpha[:, None], acc[1] * alpha[:, None])
    else:
        acc = acc * alpha[:, None]
    return acc


@triton.jit
def _load_tile(ptrs, row_ok, col_ok, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Loads ptrs [R, C], zeros where row_ok [R] (if ROWS) or col_ok [C] (if COLS) is false:
    a mask only where needed, since a mask along a row stops vectorized loads."""
    if ROWS:
        if COLS:
            mask = row_ok[:, None] & col_ok[None, :]
        else:
            mask = row_ok[:, None]
        x = tl.load(ptrs, mask=mask, other=0.0)
    elif COLS:
        x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, k_cache, v_cache, table, kv_head, stride_b, stride_s,
                  q_limit, q_first, kv_start, kv_end, tile_lo, tile_hi, qk_scale, cap,
                  HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  TILE: tl.constexpr, MASKED: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                  K_T: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    # Online softmax over the paged cache's KV tiles [tile_lo, tile_hi); only the tiles that
    # cross the causal diagonal, the end of the context or (WINDOW) a row's first key q_first
    # pay for masks. Keys before kv_start, in no row's window, are not even loaded: a scheduler
    # may free the blocks that hold them. A head_dim that is no power of two is padded to
    # HEAD_PAD with zeros.
    PADDED: tl.constexpr = HEAD_PAD != HEAD_DIM
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_p = tl.arange(0, HEAD_PAD // 2)
    d_ok = offs_d < HEAD_DIM
    for j in range(tile_lo, tile_hi):
        k_pos = j * TILE + offs_t
        in_range = k_pos < kv_end
        if MASKED:
            if WINDOW:
                in_range = in_range & (k_pos >= kv_start)
            block = tl.load(table + k_pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        else:
            block = tl.load(table + k_pos // BLOCK_SIZE).to(tl.int64)
        # K and V share one layout: one offset vector serves both.
        slot = block * stride_b + (k_pos % BLOCK_SIZE) * stride_s + kv_head
        v_off = slot[:, None] + offs_d[None, :]
        if K_T:
            k_off = slot[None, :] + offs_d[:, None]
        else:
            k_off = v_off
        if K_T:
            k = _load_tile(k_cache + k_off, d_ok, in_range, PADDED, MASKED)
        else:
            k = _load_tile(k_cache + k_off, in_range, d_ok, MASKED, PADDED)
        if v_cache.dtype.element_ty == tl.int16:
            v = _load_tile(v_cache + ((slot // 2)[:, None] + offs_p[None, :]), in_range,
                           offs_p < HEAD_DIM // 2, MASKED, PADDED)
        else:
            v = _load_tile(v_cache + v_off, in_range, d_ok, MASKED, PADDED)
        if MASKED:
            visible = (k_pos[None, :] <= q_limit[:, None]) & in_range[None, :]
            if WINDOW:
                visible = visible & (k_pos[None, :] >= q_first[:, None])
        else:
            visible = 0
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, visible, qk_scale, cap, MASKED,
                                      LAZY_RESCALE, K_T, SOFTCAP)
    return acc, l_i, m_i


@triton.jit
def _attend_fresh_tiles(acc, l_i, m_i, q, k_desc, v_desc, q_start, column, q_fresh, window,
                        query_len, tile_lo, tile_hi, qk_scale, cap, TILE: tl.constexpr,
                        MASKED: tl.constexpr, LAZY_RESCALE: tl.constexpr, WINDOW: tl.constexpr,
                        SOFTCAP: tl.constexpr):
    # The same over the sequence's own new keys, tiles [tile_lo, tile_hi) counted from its first
    # new token, read by the tensor-memory accelerator straight from this step's k and v.
    offs_t = tl.arange(0, TILE)
    for j in range(tile_lo, tile_hi):
        k = k_desc.load([q_start + j * TILE, column])
        v = v_desc.load([q_start + j * TILE, column])
        k_fresh = j * TILE + offs_t
        visible = (k_fresh[None, :] <= q_fresh[:, None]) & (k_fresh[None, :] < query_len)
        if WINDOW:
            visible = visible & (k_fresh[None, :] > q_fresh[:, None] - window)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, visible, qk_scale, cap, MASKED,
                                      LAZY_RESCALE, False, SOFTCAP)
    return acc, l_i, m_i


@triton.jit
def _attend_span(acc, l_i, m_i, q, k_cache, v_cache, table, kv_head, stride_b, stride_s,
                 q_limit, q_first, kv_start, kv_end, tile_lo, tile_hi, first_full, num_full,
                 qk_scale, cap, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                 K_T: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 ONE_LOOP: tl.constexpr):
    # Paged tiles [tile_lo, tile_hi): masked before first_full (a row's window starts inside
    # them) and from num_full on (the causal diagonal or kv_end cross them), unmasked between;
    # with ONE_LOOP all of them masked, in one loop (see AttentionConfig.one_loop).
    if ONE_LOOP:
        return _attend_tiles(acc, l_i, m_i, q, k_cache, v_cache, table, kv_head, stride_b,
                             stride_s, q_limit, q_first, kv_start, kv_end, tile_lo, tile_hi,
                             qk_scale, cap, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE, True,
                             LAZY_RESCALE, K_T, WINDOW, SOFTCAP)
    if WINDOW:
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_cache, v_cache, table, kv_head,
                                      stride_b, stride_s, q_limit, q_first, kv_start, kv_end,
                                      tile_lo, tl.minimum(tile_hi, first_full), qk_scale, cap,
                                      HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE, True, LAZY_RESCALE, K_T,
                                      WINDOW, SOFTCAP)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_cache, v_cache, table, kv_head, stride_b,
                                  stride_s, q_limit, q_first, kv_start, kv_end,
                                  tl.maximum(tile_lo, first_full), tl.minimum(tile_hi, num_full),
                                  qk_scale, cap, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE, False,
                                  LAZY_RESCALE, K_T, WINDOW, SOFTCAP)
    return _attend_tiles(acc, l_i, m_i, q, k_cache, v_cache, table, kv_head, stride_b, stride_s,
                         q_limit, q_first, kv_start, kv_end,
                         tl.maximum(tile_lo, tl.maximum(first_full, num_full)), tile_hi,
                         qk_scale, cap, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE, True,
                         LAZY_RESCALE, K_T, WINDOW, SOFTCAP)


@triton.jit
def _attend_fresh_span(acc, l_i, m_i, q, k_desc, v_desc, q_start, column, q_fresh, window,
                       query_len, tile_lo, tile_hi, first_full, num_full, qk_scale, cap,
                       TILE: tl.constexpr, LAZY_RESCALE: tl.constexpr, WINDOW: tl.constexpr,
                       SOFTCAP: tl.constexpr):
    # The same over the step's new keys.
    if WINDOW:
        acc, l_i, m_i = _attend_fresh_tiles(acc, l_i, m_i, q, k_desc, v_desc, q_start, column,
                                            q_fresh, window, query_len, tile_lo,
                                            tl.minimum(tile_hi, first_full), qk_scale, cap, TILE,
                                            True, LAZY_RESCALE, WINDOW, SOFTCAP)
    acc, l_i, m_i = _attend_fresh_tiles(acc, l_i, m_i, q, k_desc, v_desc, q_start, column,
                                        q_fresh, window, query_len,
                                        tl.maximum(tile_lo, first_full),
                                        tl.minimum(tile_hi, num_full), qk_scale, cap, TILE, False,
                                        LAZY_RESCALE, WINDOW, SOFTCAP)
    return _attend_fresh_tiles(acc, l_i, m_i, q, k_desc, v_desc, q_start, column, q_fresh,
                               window, query_len,
                               tl.maximum(tile_lo, tl.maximum(first_full, num_full)), tile_hi,
                               qk_scale, cap, TILE, True, LAZY_RESCALE, WINDOW, SOFTCAP)


@triton.jit
def _window_tiles(first_query, kv_end, window, TILE: tl.constexpr, WINDOW: tl.constexpr):
    """(first tile any query of a block sees, first tile all of them see whole) under a sliding
    window, for queries from first_query to kv_end - 1: tiles before the first hold no visible
    key, so they are never read; (0, 0) without a window."""
    tile_first = 0
    first_full = 0
    if WINDOW:
        tile_first = tl.maximum(first_query - window + 1, 0) // TILE
        first_full = tl.cdiv(tl.maximum(kv_end - window, 0), TILE)
    return tile_first, first_full


# num_seqs changes every step: specialising on it (== 1, multiple of 16) would recompile mid-run.
# The split count is a run-time value, so that a step whose split count no earlier step used
# (mixed steps choose theirs from their shape) does not compile a kernel in the middle of serving;
# so is `rows`, so that a mixed step's two launches use the kernels that prefill and decode
# steps compile.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "rows", "window"])
def _attention_kernel(out, part_acc, part_ml, q_ptr, k_cache, v_cache, k_scale_ptr, v_scale_ptr,
                      k_desc, v_desc, block_tables, seq_lens, query_start_loc, qk_scale, cap,
                      window, num_seqs, num_splits, rows, num_heads,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_b, stride_s, stride_h,
                      stride_bt, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr,
                      TILE: tl.constexpr, SPLIT: tl.constexpr, KV_SCALED: tl.constexpr,
                      REVERSE: tl.constexpr, LAZY_RESCALE: tl.constexpr, FRESH: tl.constexpr,
                      K_T: tl.constexpr, DOT_FP16: tl.constexpr, WINDOW: tl.constexpr,
                      SOFTCAP: tl.constexpr, ONE_LOOP: tl.constexpr, HEADS_FIRST: tl.constexpr,
                      V_PAIRS: tl.constexpr, PDL: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    if HEADS_FIRST:
        kv_head, block, num_blocks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    else:
        kv_head, block, num_blocks = tl.program_id(1), tl.program_id(0), tl.num_programs(0)
    if REVERSE:
        # Causal work grows along a sequence: start the longest q blocks first so that the
        # short ones fill the tail of the grid (FlashAttention-2's order).
        q_block = num_blocks - 1 - block
    else:
        q_block = block
    split = tl.program_id(2)

    if rows == _DECODE_ROWS:
        seq = block
    else:
        seq = _find_seq(query_start_loc, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    query_len = tl.load(query_start_loc + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    # The step's metadata was uploaded before its first kernel, so the search above and these
    # loads ran before the wait (see kernels/pdl.py); q and the cache are read after it. Every
    # program waits, also one that has no work, so that this launch ends after the one before.
    pdl.wait_for_previous(PDL)
    if rows == _DECODE_ROWS:
        q_local = 0
    else:
        q_local = q_block - (q_start // BLOCK_Q + seq)
    # A parted launch skips the other launch's sequences.
    other_launch = (rows != _ALL_ROWS) & ((query_len == 1) != (rows == _DECODE_ROWS))
    if (q_local * BLOCK_Q >= query_len) | other_launch:
        return
    context_len = seq_len - query_len

    PADDED: tl.constexpr = HEAD_PAD != HEAD_DIM
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    q_pos = q_local * BLOCK_Q + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (q_pos < query_len) & (offs_m % GROUP_PAD < GROUP)
    token = (q_start + q_pos).to(tl.int64)
    q = _load_tile(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                   + offs_d[None, :], row_ok, d_ok, True, PADDED)
    if DOT_FP16:
        # An fp8 cache's products run in fp16: E4M3 widens to fp16 in one instruction per pair
        # but to bf16 only through fp32 (1.3x the decode time at 64 x 4k on an H200), and fp16
        # keeps more of q and p than the cache's 3 mantissa bits lose.
        q = q.to(tl.float16)

    # Keys visible to the block's last query, and the prefix of whole tiles every query sees
    # (from first_full on, under a sliding window).
    first_query = context_len + q_local * BLOCK_Q
    kv_end = tl.minimum(first_query + BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(kv_end, TILE)
    num_full = tl.minimum(first_query + 1, kv_end) // TILE
    tile_first, first_full = _window_tiles(first_query, kv_end, window, TILE, WINDOW)
    if SPLIT:
        # Segments cut the tiles the block reads, not those before its window.
        per_split = tl.cdiv(num_tiles - tile_first, num_splits)
        tile_lo = tl.minimum(tile_first + split * per_split, num_tiles)
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    else:
        tile_lo = tile_first
        tile_hi = num_tiles

    if KV_SCALED:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    table = block_tables + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_h
    q_limit = context_len + q_pos
    q_first = q_limit - window + 1
    kv_start = first_query - window + 1
    if V_PAIRS:
        # p @ v reduces over a V tile's tokens, but the cache holds its head dims contiguous: a
        # 16-bit tile transposes on its way from shared memory (ldmatrix.trans), which has no
        # 8-bit form, so an fp8 tile went one byte a load (128 loads a thread per 128-token tile,
        # 254 registers for sm_90). Read as int16 pairs of head dims it transposes as a 16-bit
        # tile and widens in registers into the even and the odd head dims, accumulated apart
        # and interleaved once at the end (151 registers, no byte loads). On the H200 an fp8
        # cache's decode at 512 rows of U[150,1100] then took 0.64 of the bf16 cache's time,
        # against 0.84 (BENCHMARKS.md, 2026-12-05).
        v_cache = v_cache.to(tl.pointer_type(tl.int16))
        acc = (tl.zeros([BLOCK_M, HEAD_PAD // 2], dtype=tl.float32),
               tl.zeros([BLOCK_M, HEAD_PAD // 2], dtype=tl.float32))
    else:
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if FRESH:
        # Unsplit: the cached context from the paged cache (only its last, partial tile and
        # those where a row's window starts masked), then the new keys from k_desc / v_desc.
        acc, l_i, m_i = _attend_span(acc, l_i, m_i, q, k_cache, v_cache, table, kv_head_off,
                                     stride_b, stride_s, q_limit, q_first, kv_start, context_len,
                                     tile_lo, tl.cdiv(context_len, TILE), first_full,
                                     context_len // TILE, qk_scale, cap, HEAD_DIM, HEAD_PAD,
                                     BLOCK_SIZE, TILE, LAZY_RESCALE, K_T, WINDOW, SOFTCAP, False)
        first_fresh = q_local * BLOCK_Q
        fresh_end = tl.minimum(first_fresh + BLOCK_Q, query_len)
        fresh_lo, fresh_first_full = _window_tiles(first_fresh, fresh_end, window, TILE, WINDOW)
        acc, l_i, m_i = _attend_fresh_span(acc, l_i, m_i, q, k_desc, v_desc, q_start,
                                           kv_head * HEAD_DIM, q_pos, window, query_len,
                                           fresh_lo, tl.cdiv(fresh_end, TILE), fresh_first_full,
                                           (first_fresh + 1) // TILE, qk_scale, cap, TILE,
                                           LAZY_RESCALE, WINDOW, SOFTCAP)
    else:
        acc, l_i, m_i = _attend_span(acc, l_i, m_i, q, k_cache, v_cache, table, kv_head_off,
                                     stride_b, stride_s, q_limit, q_first, kv_start, kv_end,
                                     tile_lo, tile_hi, first_full, num_full, qk_scale, cap,
                                     HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE, LAZY_RESCALE, K_T,
                                     WINDOW, SOFTCAP, ONE_LOOP)
    if V_PAIRS:
        acc = tl.reshape(tl.join(acc[0], acc[1]), [BLOCK_M, HEAD_PAD])
    if KV_SCALED:
        acc = acc * tl.load(v_scale_ptr)

    if SPLIT:
        # Partials are [num_tokens, num_heads, num_splits, (HEAD_PAD | 2)] fp32; an empty
        # segment still writes (m=-inf, l=0, acc=0) so the merge never reads stale memory.
        row = (token * num_heads + head) * num_splits + split
        tl.store(part_acc + row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml + row * 2, m_i, mask=row_ok)
        tl.store(part_ml + row * 2 + 1, l_i, mask=row_ok)
    else:
        o_ptrs = out + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        o_ok = row_ok[:, None]
        if PADDED:
            o_ok = o_ok & d_ok[None, :]
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=o_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(out, part_acc, part_ml, stride_ot, stride_oh, num_heads, num_splits,
                  HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr,
                  PDL: tl.constexpr):
    pdl.wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, MAX_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    used = offs_s < num_splits
    row = (token * num_heads + head) * num_splits + offs_s
    m = tl.load(part_ml + row * 2, mask=used, other=float("-inf"))
    l_s = tl.load(part_ml + row * 2 + 1, mask=used, other=0.0)
    acc = tl.load(part_acc + row[:, None] * HEAD_PAD + offs_d[None, :], mask=used[:, None],
                  other=0.0)
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - m_max)
    o = (tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)).to(out.dtype.element_ty)
    o_ptrs = out + token * stride_ot + head * stride_oh + offs_d
    if HEAD_PAD != HEAD_DIM:
        tl.store(o_ptrs, o, mask=offs_d < HEAD_DIM)
    else:
        tl.store(o_ptrs, o)


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """One launch's tiling: rows per program (query positions x the padded GQA group), KV tokens
    per loop step, warps, software-pipeline stages; `reverse` starts the last (longest causal)
    q blocks first, `lazy_rescale` rescales the accumulator only when a row's max grows by more
    than 2^8, `fresh_kv` reads each sequence's new keys and values through tensor descriptors
    (TMA on Hopper) from the k_new / v_new given to `paged_attention` rather than from the
    paged cache, `k_transposed` loads cached keys as [head_dim, tile], `one_loop` attends every
    KV tile in one masked loop rather than masked and unmasked spans (in launches with neither a
    sliding window nor a soft cap)."""
    block_m: int
    tile: int
    num_warps: int
    num_stages: int
    reverse: bool = False
    lazy_rescale: bool = False
    fresh_kv: bool = False
    k_transposed: bool = False
    one_loop: bool = False


def default_config(group_pad: int, head_dim: int, elem_bytes: int, max_query_len: int,
                   fresh_kv: bool = False, kv_bytes: int | None = None,
                   num_tokens: int | None = None, device: torch.device | None = None) -> AttentionConfig:
    """The tiling `paged_attention` picks when given none for a launch of num_tokens queries (None:
    as many as a prefill tiling suits) on `device`; `fresh_kv` when it is given k_new; elem_bytes
    is the query's element size, kv_bytes the cache's (default: the same)."""
    # Decode rows fill BLOCK_M with the GQA group (16 rows is the smallest tensor-core tile)
    # and stream 16 KiB KV tiles, K loaded [head_dim, tile]. A sweep on an H200 (Llama-3.1-8B
    # shape, batch 64-512 x context 1k-16k) measured bf16 fastest with 64-token tiles and 2
    # stages: 0.260 ms at 64 x 4k (K loaded [tile, head_dim] 0.325, 3 stages 0.359); fp8 with
    # 128-token tiles and 3 stages: 0.200 ms (64-token tiles 0.252, 2 stages 0.206), and 2.85
    # ms at 256 x 16k against 3.92 for bf16.
    # Tiles hold heads padded to a power of two (Phi-3-mini's 96 dims as 128).
    head_dim = triton.next_power_of_2(head_dim)
    decode = max_query_len * group_pad <= 16
    if decode or small_step(num_tokens):
        kv_bytes = kv_bytes or elem_bytes
        tile = max(16, min(128, 16384 // (head_dim * kv_bytes)))
        rows = 16 if decode or num_tokens <= SMALL_STEP_TOKENS else 64
        # 16-row programs read few tiles (a decode graph's segments hold 1-3), so a software
        # pipeline's fill and drain per span cost more than masking every tile: one masked loop
        # took, in us per layer on an H200 (Llama-3.1-8B shape, CUDA graphs of 32 calls, bf16 /
        # fp8 KV), 15.4 / 15.5 against 16.8 / 20.1 at 8 rows x 700 keys, 16.2 / 19.7 against
        # 21.3 / 23.4 at 16 x 600, 47.2 / 48.7 against 49.1 / 51.8 at 42 x 720, 70.7 / 60.8
        # against 75.0 / 64.1 for 42 rows beside a 64-token chunk over 2,000 keys, 294 against
        # 321 for fp8 at 512 x 150-1,100 (its kernel no longer spills), and the same at 32 x 600
        # in bf16; 64-row programs of medium steps lost (31.2 against 28.5 at 10 rows beside
        # 2 x 246 prompt tokens), and so did Gemma 2 9B's windowed, soft-capped layers (32-token
        # tiles): 13.93 ms a decode step at 16 rows x 6,000 keys against 13.24 in spans, which
        # such launches keep. End to end: BENCHMARKS.md.
        # A decode step's fp8 launch of 256 rows or more keeps 5 tiles in flight on Hopper: on an
        # H200, 187.0 against 193.5 us at 512 rows x 150-1,100 keys, 148.4 against 153.9 at 256 x
        # 1,024; at 16-42 rows in graphs and 64 x 4,096 the same or up to 8% slower (BENCHMARKS.md,
        # 2026-12-06). A mixed step's decode launch, not measured so, keeps 3. Five stages of
        # 16 KiB K and V tiles need 160 KiB of shared memory, which Hopper's 227 KiB holds and
        # Ada's 99 (L4, L40S) does not.
        deep = kv_bytes < 2 and num_tokens is not None and num_tokens >= 256 and _hopper(device)
        return AttentionConfig(max(rows, group_pad), tile, num_warps=4,
                               num_stages=2 if kv_bytes >= 2 else 5 if deep else 3,
                               k_transposed=True, one_loop=rows == 16)
    # Prefill: 128-row tiles so a KV tile is reused by many queries, 128-token KV tiles (32 KiB),
    # longest q blocks first (FlashAttention-2's order), the step's own keys through TMA when
    # given. `python -m pagedserve.bench.kernels --prefill-sweep` on an H200 (torch 2.11,
    # triton 3.6; 8192 tokens per launch as 2 x 4096 and 1 x 16384) measured, in TFLOP/s:
    # fresh_kv 471 / 515 (the fastest), this tiling without it 366 / 422, the 64-token tiling
    # before 304 / 350, the lazy rescale 425 / 491 (slower), 2 stages 409 / 480, 64-row tiles
    # 361 / 442; SDPA 528 at 2 x 4096 in its default dispatch (cuDNN), 280 / 332 forced to FA2.
    tile = max(16, min(128, 32768 // (head_dim * elem_bytes)))
    block_m = max(group_pad, 128 if head_dim * elem_bytes <= 256 else 64)
    return AttentionConfig(block_m, tile, num_warps=8, num_stages=3 if elem_bytes <= 2 else 2,
                           reverse=True, fresh_kv=fresh_kv)


def choose_num_splits(num_q_blocks: int, num_kv_heads: int, max_seq_len: int, tile: int,
                      num_sms: int) -> int:
    """KV segments per sequence: split only when the unsplit grid cannot fill the GPU.

    With fewer than 2 programs per multiprocessor (small decode batches, few KV heads), each
    sequence's KV is cut into a power-of-two number of segments so the grid reaches about 4
    programs per multiprocessor, capped at 16 segments and at one segment per 2 KV tiles of
    the longest context. On an H200 (132 SMs, Llama-3.1-8B shape, ctx 1k-16k) it chose the
    fastest of the segment counts measured at every batch from 8 to 256.
    """
    programs = num_q_blocks * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    splits = triton.next_power_of_2(triton.cdiv(4 * num_sms, programs))
    while splits > 1 and 2 * splits * tile > max_seq_len:
        splits //= 2
    return min(splits, MAX_SPLITS)


def default_num_splits(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                       head_dim: int, elem_bytes: int, max_query_len: int, max_seq_len: int,
                       device: torch.device, kv_bytes: int | None = None) -> int:
    """The KV segment count `paged_attention` picks when none is given: a CUDA graph fixes it
    for its batch size at capture."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    cfg = default_config(group_pad, head_dim, elem_bytes, max_query_len, kv_bytes=kv_bytes,
                         num_tokens=num_tokens, device=device)
    return _num_splits(cfg, group_pad, num_tokens, num_seqs, num_kv_heads, max_query_len,
                       max_seq_len, device)


def _num_splits(cfg: AttentionConfig, group_pad: int, num_tokens: int, num_seqs: int,
                num_kv_heads: int, max_query_len: int, max_seq_len: int,
                device: torch.device) -> int:
    block_q = cfg.block_m // group_pad
    # With short queries (decode rows) each sequence busies one q block per KV head.
    busy_blocks = num_seqs if max_query_len <= block_q else num_tokens // block_q + num_seqs
    return choose_num_splits(busy_blocks, num_kv_heads, max_seq_len, cfg.tile, _num_sms(device))


def _decode_launch(config: AttentionConfig | None, group_pad: int, head_dim: int, q: torch.Tensor,
                   k_cache: torch.Tensor, num_decode_seqs: int, num_kv_heads: int,
                   max_query_len: int, max_seq_len: int, num_splits: int) -> AttentionConfig | None:
    """The tiling of a second launch for a mixed step's decode rows, or None to attend them with
    the prefill chunks. In the prefill tiling a decode row fills 4 of a program's 128 rows:
    on an H200 (Llama-3.1-8B shape, 16,384 tokens of prompts of 128-1,024 tokens plus 250 / 480
    decode rows of contexts 150-1,100) one launch took 851 / 1,201 us a layer, the prefill chunks
    alone 446 / 425 and the decode rows alone 182 / 328. Only unsplit launches are parted, since
    each split launch's merge writes every token's output; steps of small tiles are not."""
    if (config is not None or not num_decode_seqs or max_query_len == 1 or num_splits > 1
            or small_step(len(q))):
        return None
    cfg = default_config(group_pad, head_dim, q.element_size(), 1, kv_bytes=k_cache.element_size())
    splits = _num_splits(cfg, group_pad, num_decode_seqs, num_decode_seqs, num_kv_heads, 1,
                         max_seq_len, q.device)
    return cfg if splits == 1 else None


def _rows_descriptor(x: torch.Tensor, tile: int) -> TensorDescriptor:
    """x [num_tokens, num_kv_heads, head_dim] (heads contiguous) as a 2-D descriptor that loads
    [tile, head_dim] boxes at (token, kv_head * head_dim); rows past the end read zeros."""
    num_tokens, num_kv_heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError(f"k_new and v_new need contiguous heads, got strides {x.stride()}")
    return TensorDescriptor(x, [num_tokens, num_kv_heads * head_dim], [x.stride(0), 1],
                            [tile, head_dim])


def _hopper(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, max_query_len: int | None = None,
                    max_seq_len: int | None = None, num_splits: int | None = None,
                    out: torch.Tensor | None = None,
                    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    config: AttentionConfig | None = None, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, num_decode_seqs: int = 0,
                    sliding_window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context, in one launch.

    Same layouts and result as `paged_attention_ref`, sliding window and soft-capping
    included: a query at position i sees the keys j <= i with i - j < sliding_window (None or 0:
    all), and reads no KV tile wholly before its window; `softcap` (None or 0: none) caps the
    scaled scores at +-softcap through tanh. Their values are run-time arguments: one compiled
    kernel serves every window and every cap, also inside a CUDA graph.
    `max_query_len` and `max_seq_len` are host-known upper bounds (defaults: all tokens, the
    block table's capacity); they only pick tile shapes and the split count, so no device value
    is read on the host. `num_splits` forces the number of KV segments (1 = no split-KV, at most
    MAX_SPLITS); `out` receives the result if given. An fp8 cache holds K / k_scale and
    V / v_scale (kv_scales: float32 [] tensors; none means 1.0). `config` overrides the tiling
    (`default_config`).
    k_new and v_new [num_tokens, num_kv_heads, head_dim] (rotated k) are this step's keys and
    values, as the cache holds them; a `fresh_kv` config (the default prefill one when they are
    given) reads them instead of their cache slots when the launch is unsplit and the cache is
    not fp8 (whose values differ from them); decode tilings ignore them.
    num_decode_seqs: how many of the sequences have a single query (decode rows), host-known;
    with prefill chunks beside them, no `config` and more than MEDIUM_STEP_TOKENS tokens in all,
    they get a launch of the decode tiling (fewer tokens attend in one launch of small tiles).
    The last dim of q, out and the caches must be contiguous, and k_cache and v_cache share
    their strides; other strides are free.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must share strides, got {k_cache.stride()} and "
                         f"{v_cache.stride()}: allocate them as halves of one tensor or alike")
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = triton.next_power_of_2(head_dim)
    num_seqs = seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = num_tokens
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    # A window no context outgrows masks nothing.
    windowed = bool(sliding_window) and sliding_window < max_seq_len
    # Under a window a query block reads at most window + max_query_len keys.
    attended_len = min(max_seq_len, sliding_window + max_query_len) if windowed else max_seq_len
    capped = bool(softcap)
    cfg = config or default_config(group_pad, head_dim, q.element_size(), max_query_len,
                                   fresh_kv=k_new is not None, kv_bytes=k_cache.element_size(),
                                   num_tokens=num_tokens, device=q.device)
    if cfg.block_m < group_pad:
        raise ValueError(f"block_m {cfg.block_m} is below the padded GQA group {group_pad}")
    block_q = cfg.block_m // group_pad
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = _num_splits(cfg, group_pad, num_tokens, num_seqs, num_kv_heads,
                                 max_query_len, attended_len, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be 1 to {MAX_SPLITS}, got {num_splits}")
    fp8 = is_fp8(k_cache)
    scaled = fp8 and kv_scales is not None
    k_scale, v_scale = kv_scales if scaled else (None, None)
    # Tensor descriptors load whole power-of-two heads: a padded head reads its cache.
    fresh = (cfg.fresh_kv and k_new is not None and num_splits == 1 and not fp8
             and head_pad == head_dim)
    k_desc, v_desc = ((_rows_descriptor(k_new, cfg.tile), _rows_descriptor(v_new, cfg.tile))
                      if fresh else (None, None))
    if out is None:
        out = torch.empty_like(q)
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_pad, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32,
                              device=q.device)
    else:
        part_acc = part_ml = out
    launch = pdl.launch_args(q.device)
    # Capped scores scale by scale / softcap inside the tanh and by softcap after it.
    qk_scale, cap = (scale / softcap, softcap * LOG2E) if capped else (scale * LOG2E, 1.0)

    def attend(cfg: AttentionConfig, grid: int, rows: int, descs: tuple) -> None:
        # A launch that searches for its sequences sizes its grid for the worst case: a mixed
        # graph of 256 tokens has 321 q blocks a KV head, of which about 73 hold queries. With
        # the heads as the fastest grid axis every program with work is dispatched before the
        # empty ones, which then fill the tail instead of holding slots ahead of the next
        # head's work. On an H200 (Llama-3.1-8B shape, 32 layers in a CUDA graph, decode
        # contexts uniform in 128..1,536, 2026-12-04), us a layer: 9 decode rows + 247 prompt
        # tokens over 500 cached 45.8 against 57.4, 29 + 227 over 300 56.2 against 67.7, 40 +
        # 400 over 100 (512 tokens) 62.6 against 81.5; graphs of 32-192 tokens within 1%. A
        # decode launch has no empty programs, and at 60 rows took 66.2 against 64.2 so. A grid's
        # second axis holds at most 65,535 programs.
        heads_first = rows != DECODE_ROWS and grid <= 65535
        _attention_kernel[(num_kv_heads, grid, num_splits) if heads_first
                          else (grid, num_kv_heads, num_splits)](
            out, part_acc, part_ml, q, k_cache, v_cache, k_scale, v_scale, *descs, block_tables,
            seq_lens, query_start_loc, qk_scale, cap, sliding_window if windowed else 0,
            num_seqs, num_splits, rows, num_heads,
            *q.stride()[:2], *out.stride()[:2], *k_cache.stride()[:3], block_tables.stride(0),
            GROUP=group, GROUP_PAD=group_pad, BLOCK_M=cfg.block_m, HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            BLOCK_SIZE=block_size, TILE=cfg.tile, SPLIT=num_splits > 1, KV_SCALED=scaled,
            REVERSE=cfg.reverse, LAZY_RESCALE=cfg.lazy_rescale, FRESH=descs[0] is not None,
            K_T=cfg.k_transposed, DOT_FP16=fp8, WINDOW=windowed, SOFTCAP=capped,
            ONE_LOOP=cfg.one_loop and not windowed and not capped, HEADS_FIRST=heads_first,
            V_PAIRS=fp8 and cfg.block_m == 16 and head_dim % 2 == 0,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **launch)

    decode_cfg = _decode_launch(config, group_pad, head_dim, q, k_cache, num_decode_seqs,
                                num_kv_heads, max_query_len, attended_len, num_splits)
    if max_query_len == 1:
        # One program per sequence: none searches for its sequence or finds no query.
        attend(cfg, num_seqs, DECODE_ROWS, (k_desc, v_desc))
    else:
        attend(cfg, num_q_blocks, ALL_ROWS if decode_cfg is None else PREFILL_ROWS,
               (k_desc, v_desc))
    if decode_cfg is not None:
        attend(decode_cfg, num_seqs, DECODE_ROWS, (None, None))
    if num_splits > 1:
        # One warp a head: its reduction over the segments stays in the warp, where four warps
        # meet in shared memory. On an H200 (Llama-3.1-8B shape, 32 layers in a CUDA graph,
        # contexts uniform in 128..1,536, 2026-12-04) attention and merge took, us a layer, 18.3
        # against 21.9 at 9 rows (8 segments), 28.2 against 32.3 at 21 (4), 33.4 against 38.6 at 29.
        _merge_kernel[(num_tokens, num_heads)](out, part_acc, part_ml, out.stride(0),
                                               out.stride(1), num_heads, num_splits,
                                               HEAD_DIM=head_dim, HEAD_PAD=head_pad,
                                               MAX_SPLITS=MAX_SPLITS, num_warps=1, **launch)
    return out
