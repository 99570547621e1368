"""Shared helpers of the kernel tests: device, tolerances, poisoning, random paged batches."""
import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# ||out - ref|| / ||ref||: fp32 covers tf32 tensor-core products on the GPU.
TOLERANCE = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, products: int = 1) -> None:
    """`products`: how many chained matrix products the output went through, each adding its
    rounding (tf32's, for float32 on a GPU)."""
    assert out.shape == ref.shape
    assert not out.isnan().any(), "unwritten (poisoned) or NaN elements in the output"
    err = rel_err(out, ref)
    assert err < products * TOLERANCE[ref.dtype], f"relative error {err:.2e}"


def poison_next_alloc(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Frees a NaN-filled buffer so that the kernel's own output allocation of the same size
    most likely reuses it (the CUDA caching allocator and glibc both recycle it): an output
    element the kernel leaves unwritten then reads NaN instead of stale data."""
    torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def skip_bf16_dot_on_cpu(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("the Triton CPU interpreter computes tl.dot on bf16 as integers; "
                    "bf16 attention is tested on the GPU only")


def random_paged_kv(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype, spare_blocks: int = 3
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k_cache, v_cache and a block table for sequences of `seq_lens` tokens, on shuffled,
    non-contiguous block ids. Slots past each context and unused blocks hold NaN, so reading
    one shows up in the output; block-table padding points far out of the cache."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    ids = torch.randperm(num_blocks)[:sum(blocks_per_seq)].int()
    width = max(blocks_per_seq) + 1
    table = torch.full((len(seq_lens), width), 1 << 20, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        table[i, :nb] = ids[used:used + nb]
        used += nb
        slots = table[i, :nb].long()[:, None] * block_size + torch.arange(block_size)
        slots = slots.flatten()[:n]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim,
                                                                      dtype=dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim,
                                                                      dtype=dtype)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE)
