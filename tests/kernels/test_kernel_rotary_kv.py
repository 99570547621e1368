import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, assert_close
from pagedserve.kernels.reference import rotary_ref, write_kv_ref
from pagedserve.kernels.rotary import rotary_write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [4, 16])
def test_rotary_write_kv_matches_rotary_then_write_kv(dtype: torch.dtype, group: int,
                                                      block_size: int) -> None:
    num_kv_heads, head_dim, num_blocks = 2, 64, 9
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
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype,
                      device=DEVICE)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    cos_sin_cache = torch.randn(20, head_dim, device=DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    ref_q, ref_k = rotary_ref(positions, q, k, cos_sin_cache)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    write_kv_ref(ref_k, v, ref_k_cache, ref_v_cache, slots)
    kv_before = qkv[:, num_heads * head_dim:].clone()

    assert rotary_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slots) is q

    assert_close(q, ref_q)
    assert torch.equal(qkv[:, num_heads * head_dim:], kv_before)
    written = slots[slots >= 0]
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    k_slots, v_slots = (c.view(-1, num_kv_heads, head_dim) for c in (k_cache, v_cache))
    assert_close(k_slots[written], ref_k_cache.view(-1, num_kv_heads, head_dim)[written])
    assert torch.equal(v_slots[written], ref_v_cache.view(-1, num_kv_heads, head_dim)[written])
    assert k_slots[untouched].isnan().all() and v_slots[untouched].isnan().all()
