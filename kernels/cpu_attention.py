"""Paged decode attention on the CPU: the whole batch in a few batched matmuls over its gathered
blocks, rather than the reference's loop of per-sequence gathers, repeats and softmaxes (whose
small ops cost more than their arithmetic here; torch's SDPA is slower still for one query).
Layouts as in kernels/reference.py; these take no fp8 cache and no padding slot (-1). Slots past
a context must hold finite values (a served cache is zeroed at allocation): masked out of the
scores, they still meet their zero weights in the product with V."""
import torch


def write_kv_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes each token's k, v at its slot (none may be -1)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """One query per sequence (q [B, heads, head_dim]) over its first seq_lens keys: the batch's
    blocks gathered once, padded to the longest context and masked past each one's length. The
    query heads sharing a KV head multiply its keys together, one KV head at a time: a head's
    keys are then a strided matrix that bmm reads in place, where a transpose would copy them."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    table = block_tables[:, :-(-int(seq_lens.max()) // block_size)]
    k = _gather(k_cache, table)
    v = _gather(v_cache, table)
    hidden = torch.arange(k.shape[1]) >= seq_lens[:, None]
    qs = q.view(batch, num_kv_heads, -1, head_dim)
    out = torch.empty_like(qs)
    for h in range(num_kv_heads):
        scores = torch.bmm(qs[:, h], k[:, :, h].transpose(1, 2)).float() * scale
        scores.masked_fill_(hidden[:, None], float("-inf"))
        out[:, h] = torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), v[:, :, h])
    return out.view(batch, num_heads, head_dim)


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[B, len(table[0]) * block_size, kv_heads, head_dim]: each sequence's blocks, in order
    (index_select copies whole blocks several times faster than advanced indexing here)."""
    blocks = torch.index_select(cache, 0, table.flatten())
    return blocks.view(table.shape[0], -1, *cache.shape[2:])
