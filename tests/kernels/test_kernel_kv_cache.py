import pytest
import torch

from kernel_testing import DEVICE
from kernels.kv_cache import write_kv
from kernels.reference import write_kv_ref


@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.bfloat16),
                                                   (torch.float32, torch.float32)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_write_kv_skips_padding_slots(src_dtype: torch.dtype, cache_dtype: torch.dtype,
                                      block_size: int) -> None:
    num_tokens, num_kv_heads, head_dim, num_blocks = 11, 3, 32, 5
    # key and value as column slices of a fused projection, so their token stride is wide.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim, dtype=src_dtype, device=DEVICE)
    key = kv[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[[2, 5, 10]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, ref_k, ref_v, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    # The interpreter rounds fp32 -> bf16 differently from torch: allow the dtype's rounding.
    torch.testing.assert_close(k_cache, ref_k, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, equal_nan=True)
    assert k_cache.isnan().sum() == (num_blocks * block_size - 8) * num_kv_heads * head_dim
