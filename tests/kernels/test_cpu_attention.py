"""The CPU's batched decode attention and cache write against the references."""
import pytest
import torch

from pagedserve.kernels.cpu_attention import decode_attention_cpu, write_kv_cpu
from pagedserve.kernels.reference import paged_attention_ref, write_kv_ref
from tests.kernels.kernel_testing import assert_close, random_paged_kv

NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 3, 64, 16


def finite_paged_kv(seq_lens: list[int], dtype: torch.dtype):
    """random_paged_kv with the slots past each context zeroed and the block-table padding on
    block 0, as a served cache has them (zeroed at allocation, tables of valid block ids)."""
    k_cache, v_cache, table = random_paged_kv(seq_lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype)
    return k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), table.masked_fill(table >= len(k_cache), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("seq_lens", [[1], [77], [600, 3, 77, 450, 16, 17]])
def test_decode_attention_matches_the_reference(dtype, group, seq_lens):
    torch.manual_seed(0)
    k_cache, v_cache, table = finite_paged_kv(seq_lens, dtype)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * group, HEAD_DIM, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    out = decode_attention_cpu(q, k_cache, v_cache, table, lens, HEAD_DIM ** -0.5)
    ref = paged_attention_ref(q, k_cache, v_cache, table, lens, starts, HEAD_DIM ** -0.5)
    assert out.dtype == dtype
    assert_close(out, ref, products=2)


def test_write_kv_matches_the_reference():
    torch.manual_seed(0)
    shape = (8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(shape) for _ in range(4)]
    key, value = torch.randn(2, 5, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([3, 17, 40, 127, 64])
    write_kv_cpu(key, value, caches[0], caches[1], slots)
    write_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
