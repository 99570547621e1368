"""The CPU's batched decode attention, prefill attention, rotary and cache write against the
references."""
import pytest
import torch

from pagedserve.executor_svc.layers.rotary import Rope, cos_sin_cache
from pagedserve.kernels.cpu_attention import (decode_attention_cpu, decode_plan, prefill_attention_cpu,
                                              rotate, rotation, write_kv_cpu)
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
    out = decode_attention_cpu(q, k_cache, v_cache, plan_for(seq_lens, table), HEAD_DIM ** -0.5)
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
    assert torch.equal(plan.blocks.view(3, -1), table[:, :3])
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
