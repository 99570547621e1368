"""Paged attention on the CPU. A decode step's: the whole batch in one SDPA call over its rows'
contexts, which `DecodeContexts` keeps from step to step (or `gather` collects from their blocks),
rather than the reference's loop of per-sequence gathers, repeats and softmaxes (whose small ops
cost more than their arithmetic here), with its rotary embedding and cache write. A prefill step's:
an SDPA call a sequence (`prefill_attention_cpu`).

A decode step's batch is planned once (`decode_plan`: its rows, slots, blocks, mask and rotary
angles), and every layer reads the plan: the per-layer ops that derived them were a third of a
layer's ops. Layouts as in kernels/reference.py; these take no fp8 cache. Slots past a context
must hold finite values (a served cache is zeroed at allocation): masked out of the scores, they
still meet their zero weights in the product with V."""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.kernels.reference import cast, visible_keys


@dataclass(slots=True)
class DecodePlan:
    """One decode step as every layer's attention reads it. The runner pads decode steps to
    CUDA-graph sizes on every device (padding rows last, slot -1, context 1): they are left out."""
    rows: int                 # the real rows
    slots: torch.Tensor       # [rows] each row's cache slot
    table: torch.Tensor       # [rows, blocks] each row's blocks in order, the longest context's count
    lens: torch.Tensor        # [rows] each row's context length, this step's token included
    visible: torch.Tensor     # [rows, 1, 1, tokens] bool: the keys within each context
    positions: torch.Tensor   # [rows] int64
    block_size: int
    # id(cos_sin_cache) -> (cos, sin) in `rotate`'s form: a layer's table is a buffer of the model.
    rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Set by DecodeContexts.prepare where the rows' contexts are kept between steps: each row's
    # slot in the copies, and the rows to gather anew (None: all of them).
    copy_slots: torch.Tensor | None = None
    stale: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """Keys a row's context spans: its table's blocks, the longest context's count."""
        return self.table.shape[1] * self.block_size


def decode_plan(positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, block_size: int) -> DecodePlan:
    """The plan of a decode step's metadata (kernels/reference.py's layouts) and positions."""
    rows = int(torch.count_nonzero(slot_mapping >= 0))
    lens = seq_lens[:rows]
    table = block_tables[:rows, :-(-int(lens.max()) // block_size)]
    visible = torch.arange(table.shape[1] * block_size) < lens[:, None]
    return DecodePlan(rows, slot_mapping[:rows], table, lens, visible[:, None, None], positions[:rows].long(),
                      block_size)


def rotation(plan: DecodePlan, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [rows, 1, rotary_dim] float32 at the plan's positions, cos repeated over both
    halves and sin with its first half negated."""
    key = id(cos_sin_cache)
    if key not in plan.rotations:
        cos, sin = cos_sin_cache[plan.positions].float().chunk(2, dim=-1)
        plan.rotations[key] = (torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None])
    return plan.rotations[key]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] with its first rotary_dim dims rotated as kernels/reference.py's
    rotary_ref rotates them, bit for bit: x1 * cos + x2 * -sin is x1 * cos - x2 * sin exactly."""
    width, half = cos.shape[-1], cos.shape[-1] // 2
    # A whole head rotates in every model but partial-rotary ones: no slicing op for it then.
    whole = width == x.shape[-1]
    xf = cast(x if whole else x[..., :width], torch.float32)
    # roll(half) is cat((x2, x1)) in one op, not three: 11 against 25 us a rotation of 12 heads
    # of one row (the 2-core machine).
    out = cast(xf * cos + xf.roll(half, -1) * sin, x.dtype)
    return out if whole else torch.cat((out, x[..., width:]), dim=-1)


def write_kv_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes each token's k, v at its slot (none may be -1)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, cast(key, k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, cast(value, v_cache.dtype))


def decode_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DecodePlan,
                         scale: float) -> torch.Tensor:
    """One query per sequence (q [rows, heads, head_dim]) over its context (k, v [rows, tokens,
    kv_heads, head_dim]: `gather`'s or DecodeContexts'), padded to the longest context and masked
    past each one's length, in one SDPA call (SmolLM2's shape, two threads: 49 us a layer for one
    sequence of 64 keys, against 96 us for a bmm per KV head). A KV head's query heads attend as
    that head's queries, one pass over its keys for them all: 280 us at 16 rows of 192 keys
    against 367 with SDPA's enable_gqa, 196 against 250 at one row of 1,024 (SmolLM2's 9 heads on
    3 KV heads; each call after a weight-streaming GEMM)."""
    rows, heads, head_dim = q.shape
    grouped = q.view(rows, k.shape[2], heads // k.shape[2], head_dim)
    out = F.scaled_dot_product_attention(grouped, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=plan.visible, scale=scale)
    return out.view(q.shape)


def gather(cache: torch.Tensor, plan: DecodePlan, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, blocks * block_size, kv_heads, head_dim]: each of the plan's rows' blocks (or those
    of `rows`), in order (index_select copies whole blocks several times faster than advanced
    indexing here)."""
    table = plan.table if rows is None else plan.table[rows]
    return torch.index_select(cache, 0, table.flatten()).view(len(table), -1, *cache.shape[2:])


# The copies grow by this many tokens a row: each growth gathers every row anew.
CONTEXT_GROWTH = 64


class DecodeContexts:
    """Each decode row's keys and values kept in a copy of their own from one decode step to the
    next, so that a step writes only its new token into them: gathering the rows' blocks anew read
    and wrote every context once more than SDPA reads it. SmolLM2's 30 layers of decode attention
    (cache write, contexts, SDPA; the 2-core machine, each layer after a weight-streaming GEMM) took
    20.9 ms a step gathered and 15.4 ms from the copies at 16 rows of 128 keys, 12.1 and 9.1 ms at
    one row of 1,024, and the same (4.3 ms) at one row of 64.

    A row's copy holds while its row keeps its sequence: the same blocks under the context it held,
    one token longer. A step that prefills, a row that changes and growth past the copies' shape
    gather rows anew. The copies hold at most a quarter of the cache's tokens (rows times the
    longest context, rounded up to CONTEXT_GROWTH); a batch beyond that gathers every step."""

    def __init__(self) -> None:
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(k_cache) -> copies
        self.shape = (0, 0)                  # rows and tokens a layer's copies hold
        # The block table and context lengths of the rows whose contexts the copies hold (clones:
        # the runner refills its step buffers in place).
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None

    def forget(self) -> None:
        """After a step that writes the cache other than by a decode plan: gather every row anew."""
        self.held = None

    def prepare(self, plan: DecodePlan, cache_tokens: int) -> None:
        """Sets the plan's copy slots and stale rows, or leaves them None where the plan's batch
        does not fit the copies' budget (its layers then gather)."""
        rows, tokens = plan.rows, plan.tokens
        if rows > self.shape[0] or tokens > self.shape[1]:
            shape = (rows, -(-tokens // CONTEXT_GROWTH) * CONTEXT_GROWTH)
            self.buffers.clear()
            self.held = None
            self.shape = shape if shape[0] * shape[1] <= cache_tokens // 4 else (0, 0)
            if not self.shape[0]:
                return
        plan.copy_slots = torch.arange(rows) * self.shape[1] + plan.positions
        plan.stale = None if self.held is None else _stale_rows(*self.held, plan)
        self.held = (plan.table.clone(), plan.lens.clone())

    def contexts(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, plan: DecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's rows' keys and values as `gather` returns them, this step's (key, value
        [rows, kv_heads, head_dim], already in the cache) written in: gathered where the plan
        has no copies."""
        if plan.copy_slots is None:
            return gather(k_cache, plan), gather(v_cache, plan)
        copies = self.buffers.get(id(k_cache))
        if copies is None:
            # Zeros: the slots past a context meet their zero weights in SDPA, finite.
            copies = tuple(torch.zeros(*self.shape, *k_cache.shape[2:], dtype=k_cache.dtype) for _ in range(2))
            self.buffers[id(k_cache)] = copies
        return tuple(_updated(copy, new, cache, plan)[:plan.rows, :plan.tokens]
                     for copy, new, cache in zip(copies, (key, value), (k_cache, v_cache)))


def _updated(copy: torch.Tensor, new: torch.Tensor, cache: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    """`copy` with the plan's rows' contexts: stale rows gathered (this step's token in the cache
    already), the others given this step's token."""
    if plan.stale is None:
        copy[:plan.rows, :plan.tokens] = gather(cache, plan)
        return copy
    copy.view(-1, *copy.shape[2:]).index_copy_(0, plan.copy_slots, cast(new, copy.dtype))
    if len(plan.stale):
        copy[:, :plan.tokens].index_copy_(0, plan.stale, gather(cache, plan, plan.stale))
    return copy


def _stale_rows(held_table: torch.Tensor, held_lens: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    """The plan's rows whose copies do not hold their context: rows past those held, and rows
    whose blocks under the context held differ or whose context is not one token longer."""
    rows, cols = min(len(held_lens), plan.rows), min(held_table.shape[1], plan.table.shape[1])
    held_lens = held_lens[:rows]
    under = torch.arange(cols) * plan.block_size < held_lens[:, None]
    same = ((plan.table[:rows, :cols] == held_table[:rows, :cols]) | ~under).all(1)
    kept = same & (plan.lens[:rows] == held_lens + 1)
    return torch.cat((torch.nonzero(~kept).flatten(), torch.arange(rows, plan.rows)))


def prefill_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """paged_attention_ref's result without a soft cap or an fp8 cache, each sequence's queries in
    one SDPA call over its gathered context: torch's CPU flash attention never holds the [heads,
    queries, keys] scores that the reference builds, masks and softmaxes."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        if hi > lo:
            blocks = block_tables[i, :-(-seq_len // block_size)]
            out[lo:hi] = _attend(q[lo:hi], _context(k_cache, blocks, seq_len),
                                 _context(v_cache, blocks, seq_len), scale, sliding_window)
    return out


def _context(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[kv_heads, seq_len, head_dim]: a sequence's keys or values, in order."""
    return torch.index_select(cache, 0, blocks).flatten(0, 1)[:seq_len].transpose(0, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            sliding_window: int | None) -> torch.Tensor:
    """The last len(q) positions' queries [n, heads, head_dim] over keys [kv_heads, L, head_dim]."""
    n, seq_len = len(q), k.shape[1]
    mask = None
    if sliding_window or 1 < n < seq_len:
        mask = visible_keys(torch.arange(seq_len - n, seq_len), torch.arange(seq_len), sliding_window)
    # Four dims, or torch takes its math kernel, which holds the scores: 266 against 27 ms for
    # 2,048 queries of 9 heads over 3 KV heads (two threads, the 2-core machine).
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                         is_causal=mask is None and n > 1, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
