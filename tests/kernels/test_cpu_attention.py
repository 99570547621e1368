"""The CPU's batched decode attention, prefill attention, rotary and cache write against the
references."""
import pytest
import torch

from pagedserve.executor_svc.layers.rotary import Rope, cos_sin_cache
from pagedserve.kernels.cpu_attention import (CONTEXT_GROWTH, DecodeContexts, DecodePlan, decode_attention_cpu,
                                              decode_plan, gather, prefill_attention_cpu, rotate, rotation,
                                              write_kv_cpu)
from pagedserve.kernels.reference import paged_attention_ref, rotary_ref, write_kv_ref
from tests.kernels.kernel_testing import assert_close, random_paged_kv

NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 3, 64, 16


def finite_paged_kv(seq_lens: list[int], dtype: torch.dtype):
    """random_paged_kv on the CPU (which it leaves on a GPU where there is one) with the slots past
    each context zeroed and the block-table padding on block 0, as a served cache has them (zeroed
    at allocation, tables of valid block ids)."""
    k_cache, v_cache, table = (t.cpu() for t in random_paged_kv(seq_lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype))
    return k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), table.masked_fill(table >= len(k_cache), 0)


def plan_for(seq_lens: list[int], table: torch.Tensor, padding: int = 0):
    """The decode plan of one query per sequence at its last position, with `padding` rows after
    them as the runner pads a step to a CUDA-graph size (slot -1, context 1, block 0)."""
    lens = torch.tensor(seq_lens + [1] * padding, dtype=torch.int32)
    table = torch.cat((table, torch.zeros(padding, table.shape[1], dtype=table.dtype)))
    positions = lens.long() - 1
    slots = table[torch.arange(len(lens)), positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    slots[len(seq_lens):] = -1
    return decode_plan(positions, slots, table, lens, BLOCK_SIZE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("seq_lens", [[1], [77], [600, 3, 77, 450, 16, 17]])
def test_decode_attention_matches_the_reference(dtype, group, seq_lens):
    torch.manual_seed(0)
    k_cache, v_cache, table = finite_paged_kv(seq_lens, dtype)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * group, HEAD_DIM, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    plan = plan_for(seq_lens, table)
    out = decode_attention_cpu(q, gather(k_cache, plan), gather(v_cache, plan), plan, HEAD_DIM ** -0.5)
    ref = paged_attention_ref(q, k_cache, v_cache, table, lens, starts, HEAD_DIM ** -0.5)
    assert out.dtype == dtype
    assert_close(out, ref, products=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 20])
# (context, new queries) a sequence: whole prompts, chunks after a cached context, decode rows.
@pytest.mark.parametrize("sequences", [[(0, 77)], [(0, 33), (500, 100), (40, 1), (0, 1), (16, 17)]])
def test_prefill_attention_matches_the_reference(dtype, group, window, sequences):
    torch.manual_seed(0)
    seq_lens = [context + new for context, new in sequences]
    k_cache, v_cache, table = finite_paged_kv(seq_lens, dtype)
    starts = torch.tensor([0] + [new for _, new in sequences]).cumsum(0).to(torch.int32)
    q = torch.randn(int(starts[-1]), NUM_KV_HEADS * group, HEAD_DIM, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = prefill_attention_cpu(q, k_cache, v_cache, table, lens, starts, HEAD_DIM ** -0.5, window)
    ref = paged_attention_ref(q, k_cache, v_cache, table, lens, starts, HEAD_DIM ** -0.5, sliding_window=window)
    assert out.dtype == dtype
    assert_close(out, ref, products=2)


def test_decode_plan_leaves_out_the_padding_rows():
    torch.manual_seed(0)
    seq_lens = [40, 3, 17]
    _, _, table = finite_paged_kv(seq_lens, torch.float32)
    plan = plan_for(seq_lens, table, padding=5)
    assert plan.rows == 3
    assert plan.positions.tolist() == [39, 2, 16]
    # Three blocks each: the longest context's count.
    assert torch.equal(plan.table, table[:, :3])
    assert plan.visible.shape == (3, 1, 1, 3 * BLOCK_SIZE)
    assert plan.visible.sum((1, 2, 3)).tolist() == seq_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotate_is_the_references_rotary_bit_for_bit(dtype, partial):
    torch.manual_seed(0)
    table = cos_sin_cache(Rope(HEAD_DIM, partial_rotary_factor=partial), 4096)
    q = torch.randn(4, 9, HEAD_DIM, dtype=dtype) * 4
    k = torch.randn(4, 3, HEAD_DIM, dtype=dtype) * 4
    positions = torch.tensor([0, 5, 700, 4095])
    plan = plan_for([1, 6, 701, 4096], torch.zeros(4, 256, dtype=torch.int32))
    assert torch.equal(plan.positions, positions)
    cos, sin = rotation(plan, table)
    ref_q, ref_k = rotary_ref(positions, q, k, table)
    assert torch.equal(rotate(q, cos, sin), ref_q) and torch.equal(rotate(k, cos, sin), ref_k)
    # Each table's angles once a step.
    assert rotation(plan, table)[0] is cos


def test_write_kv_matches_the_reference():
    torch.manual_seed(0)
    shape = (8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(shape) for _ in range(4)]
    key, value = torch.randn(2, 5, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([3, 17, 40, 127, 64])
    write_kv_cpu(key, value, caches[0], caches[1], slots)
    write_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


class Sequences:
    """Sequences that decode over a zeroed paged cache, their blocks taken from a shuffled pool,
    and the decode plans of their steps, one row each in the order of `rows`."""

    def __init__(self, num_blocks: int) -> None:
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)
        self.free = torch.randperm(num_blocks).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def append(self, name: str, tokens: int = 1) -> torch.Tensor:
        """Writes `tokens` new random tokens of `name` (a new sequence if unknown): their slots."""
        blocks, n = self.blocks.setdefault(name, []), self.lens.get(name, 0)
        slots = []
        for position in range(n, n + tokens):
            if position % BLOCK_SIZE == 0:
                blocks.append(self.free.pop())
            slots.append(blocks[-1] * BLOCK_SIZE + position % BLOCK_SIZE)
        self.lens[name] = n + tokens
        slots = torch.tensor(slots)
        write_kv_cpu(*torch.randn(2, tokens, NUM_KV_HEADS, HEAD_DIM), self.k_cache, self.v_cache, slots)
        return slots

    def end(self, name: str) -> None:
        self.free += self.blocks.pop(name)
        del self.lens[name]

    def step(self, rows: list[str]) -> tuple[DecodePlan, torch.Tensor, torch.Tensor]:
        """A decode step of `rows`: each writes one token; (plan, key, value) of that token."""
        key, value = torch.randn(2, len(rows), NUM_KV_HEADS, HEAD_DIM)
        slots = torch.cat([self.append(name) for name in rows])
        write_kv_cpu(key, value, self.k_cache, self.v_cache, slots)
        lens = torch.tensor([self.lens[name] for name in rows], dtype=torch.int32)
        table = torch.zeros(len(rows), max(len(self.blocks[name]) for name in rows) + 2, dtype=torch.int32)
        for i, name in enumerate(rows):
            table[i, :len(self.blocks[name])] = torch.tensor(self.blocks[name])
        return decode_plan(lens.long() - 1, slots, table, lens, BLOCK_SIZE), key, value


def test_decode_contexts_hold_what_a_gather_reads_as_rows_change():
    torch.manual_seed(0)
    seqs = Sequences(num_blocks=256)
    contexts = DecodeContexts()
    for name, prompt in (("a", 40), ("b", 3), ("c", 16), ("long", CONTEXT_GROWTH - 3)):
        seqs.append(name, prompt)
    batches = ([["a", "b", "c"]] * 4 + [["a", "d", "c"]] * 2 + [["a", "d", "c", "e"]] * 2 + [["d", "c", "e"]] * 2
               + [["d", "e", "c"]] + [["d", "e", "c", "long"]] * 2 + [["d", "e", "f", "long"]] * 4)
    stale = []
    for i, rows in enumerate(batches):
        if i in (4, 8):
            seqs.end("b" if i == 4 else "a")    # its blocks go to the sequences after it
        if i == 7:
            seqs.append("c", 2)      # a step outside the plans: c is two tokens longer
        if i == 9:
            contexts.forget()
        if i == 13:
            seqs.append("f", seqs.lens["c"])    # one token past c's context, in other blocks
        plan, key, value = seqs.step(rows)
        contexts.prepare(plan, cache_tokens=4 * 4 * 2 * CONTEXT_GROWTH)
        assert plan.copy_slots is not None
        stale.append(None if plan.stale is None else plan.stale.tolist())
        held = contexts.contexts(key, value, seqs.k_cache, seqs.v_cache, plan)
        gathered = gather(seqs.k_cache, plan), gather(seqs.v_cache, plan)
        visible = plan.visible.view(plan.rows, -1)
        for copy, ref in zip(held, gathered):
            assert torch.equal(copy[visible], ref[visible])
        q = torch.randn(plan.rows, NUM_KV_HEADS * 3, HEAD_DIM)
        assert torch.equal(decode_attention_cpu(q, *held, plan, HEAD_DIM ** -0.5),
                           decode_attention_cpu(q, *gathered, plan, HEAD_DIM ** -0.5))
    # Gathered anew (None: every row): the first step; b's row taken by d; e's row past the
    # copies' shape; c two tokens on; a gone and the rest shifted up; after forget(); c and e
    # swapped; long joining; f in c's row; long past CONTEXT_GROWTH tokens.
    assert stale == [None, [], [], [], [1], [], None, [2], [0, 1, 2], None, [1, 2], [3], [], [2], None, [], []]


def test_decode_contexts_leave_a_batch_past_their_budget_to_gather():
    torch.manual_seed(0)
    seqs = Sequences(num_blocks=64)
    contexts = DecodeContexts()
    for name in "abcd":
        seqs.append(name, CONTEXT_GROWTH + 6)
    # A quarter of the cache is two growths of tokens: one row of this context, not four.
    for rows, copied in ((["a"], True), (["a", "b", "c", "d"], False), (["a"], True)):
        plan, key, value = seqs.step(rows)
        contexts.prepare(plan, cache_tokens=8 * CONTEXT_GROWTH)
        assert (plan.copy_slots is not None) == copied
        assert plan.stale is None
