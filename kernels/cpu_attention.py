"""Paged attention on the CPU. A decode step's: the whole batch in one SDPA call over its gathered
blocks, rather than the reference's loop of per-sequence gathers, repeats and softmaxes (whose small
ops cost more than their arithmetic here), with its rotary embedding and cache write. A prefill
step's: an SDPA call a sequence (`prefill_attention_cpu`).

A decode step's batch is planned once (`decode_plan`: its rows, slots, blocks, mask and rotary
angles), and every layer reads the plan: the per-layer ops that derived them were a third of a
layer's ops. Layouts as in kernels/reference.py; these take no fp8 cache. Slots past a context
must hold finite values (a served cache is zeroed at allocation): masked out of the scores, they
still meet their zero weights in the product with V."""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.kernels.reference import visible_keys


@dataclass(slots=True)
class DecodePlan:
    """One decode step as every layer's attention reads it. The runner pads decode steps to
    CUDA-graph sizes on every device (padding rows last, slot -1, context 1): they are left out."""
    rows: int                 # the real rows
    slots: torch.Tensor       # [rows] each row's cache slot
    blocks: torch.Tensor      # [rows * blocks] each row's blocks in order, the longest context's count
    visible: torch.Tensor     # [rows, 1, 1, blocks * block_size] bool: the keys within each context
    positions: torch.Tensor   # [rows] int64
    # id(cos_sin_cache) -> (cos, sin) in `rotate`'s form: a layer's table is a buffer of the model.
    rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def decode_plan(positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, block_size: int) -> DecodePlan:
    """The plan of a decode step's metadata (kernels/reference.py's layouts) and positions."""
    rows = int(torch.count_nonzero(slot_mapping >= 0))
    lens = seq_lens[:rows]
    table = block_tables[:rows, :-(-int(lens.max()) // block_size)]
    visible = torch.arange(table.shape[1] * block_size) < lens[:, None]
    return DecodePlan(rows, slot_mapping[:rows], table.flatten(), visible[:, None, None],
                      positions[:rows].long())


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
    xf = (x if whole else x[..., :width]).float()
    out = (xf * cos + torch.cat((xf[..., half:], xf[..., :half]), dim=-1) * sin).to(x.dtype)
    return out if whole else torch.cat((out, x[..., width:]), dim=-1)


def write_kv_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes each token's k, v at its slot (none may be -1)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         plan: DecodePlan, scale: float) -> torch.Tensor:
    """One query per sequence (q [rows, heads, head_dim]) over its context: the batch's blocks
    gathered once, padded to the longest context and masked past each one's length, in one SDPA
    call whose query heads share their KV head's keys in place (SmolLM2's shape, two threads: 49
    us a layer for one sequence of 64 keys, against 96 us for a bmm per KV head)."""
    k = _gather(k_cache, plan).transpose(1, 2)
    v = _gather(v_cache, plan).transpose(1, 2)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=plan.visible, scale=scale,
                                         enable_gqa=True)
    return out.view(q.shape)


def _gather(cache: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    """[rows, blocks * block_size, kv_heads, head_dim]: each row's blocks, in order
    (index_select copies whole blocks several times faster than advanced indexing here)."""
    return torch.index_select(cache, 0, plan.blocks).view(plan.rows, -1, *cache.shape[2:])


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
