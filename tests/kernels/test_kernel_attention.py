import pytest
import torch

from tests.kernels.kernel_testing import (DEVICE, assert_close, poison_next_alloc, random_paged_kv,
                            skip_bf16_dot_on_cpu)
from pagedserve.kernels import attention
from pagedserve.kernels.attention import MAX_SPLITS, choose_num_splits, paged_attention
from pagedserve.kernels.reference import paged_attention_ref

NUM_KV_HEADS = 2
# (cached prefix, new queries): decodes, a short prompt, a long prompt, chunks continuing over a
# cached prefix (one ending mid-block, one past a whole tile), and a sequence with no queries.
MIXED = [(9, 1), (0, 5), (0, 70), (37, 1), (30, 41), (130, 19), (4, 0), (0, 1)]


def run_case(batch: list[tuple[int, int]], group: int, head_dim: int, block_size: int,
             dtype: torch.dtype, num_splits: int | None, strided: bool = False,
             max_query_len: int | None = None) -> None:
    seq_lens = [c + n for c, n in batch]
    query_lens = [n for _, n in batch]
    k_cache, v_cache, table = random_paged_kv(seq_lens, NUM_KV_HEADS, head_dim, block_size, dtype)
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
    starts = torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, k_cache, v_cache, table, lens, starts, scale,
                          max_query_len=max_query_len, max_seq_len=max(seq_lens),
                          num_splits=num_splits, out=out)
    assert got is out
    ref = paged_attention_ref(q, k_cache, v_cache, table, lens, starts, scale)
    assert_close(out, ref)


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


def test_strided_q_and_cache_views() -> None:
    run_case(MIXED, 4, 32, 8, torch.float32, num_splits=2, strided=True)


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
    assert chosen == [4]
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
