"""Kernel benchmark on one GPU: copy bandwidth, decode-attention bandwidth, prefill TFLOP/s.

Run as `python -m pagedserve.bench.kernels`; prints a table, then one JSON line with every number.
Shapes are Llama-3.1-8B attention: 32 query heads, 8 KV heads, head_dim 128, bf16, block size 16.
"""
import json
import sys
from collections.abc import Callable

import torch
import triton
import triton.testing

from pagedserve.kernels.attention import paged_attention
from pagedserve.kernels.reference import paged_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_SHAPES = [(b, c) for b in (64, 256) for c in (1024, 4096, 16384)] + [(8, 16384)]
PREFILL_LENS = [1024, 4096]
PREFILL_TOKENS = 8192


def median_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def fits(nbytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes * 1.2 < free


def copy_bandwidth() -> float:
    src = torch.randn(1 << 30, dtype=DTYPE, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def paged_kv(num_seqs: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks_per_seq = ctx // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    table = torch.randperm(num_blocks, device="cuda").int().view(num_seqs, blocks_per_seq)
    return k_cache, v_cache, table


def bench_decode(batch: int, ctx: int, copy_gbps: float) -> dict | None:
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2
    if not fits(kv_bytes):
        return None
    k_cache, v_cache, table = paged_kv(batch, ctx)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    row = {"batch": batch, "ctx": ctx, "kv_gb": kv_bytes / 1e9}
    for name, splits in (("auto", None), ("unsplit", 1), ("split4", 4)):
        ms = median_ms(lambda: paged_attention(q, k_cache, v_cache, table, seq_lens, starts,
                                               HEAD_DIM ** -0.5, max_query_len=1,
                                               max_seq_len=ctx, num_splits=splits))
        gbps = kv_bytes / ms / 1e6
        row[name] = {"ms": ms, "gbps": gbps, "frac_of_copy": gbps / copy_gbps}
    return row


def bench_prefill(seq_len: int) -> dict:
    num_seqs = PREFILL_TOKENS // seq_len
    k_cache, v_cache, table = paged_kv(num_seqs, seq_len)
    q = torch.randn(num_seqs * seq_len, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * seq_len
    scale = HEAD_DIM ** -0.5
    ms = median_ms(lambda: paged_attention(q, k_cache, v_cache, table, seq_lens, starts, scale,
                                           max_query_len=seq_len, max_seq_len=seq_len))
    # SDPA on the same data, contiguous and with K/V expanded to every query head.
    group = NUM_HEADS // NUM_KV_HEADS
    k = k_cache[table.long()].reshape(num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM)
    v = v_cache[table.long()].reshape(num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM)
    k = k.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
    v = v.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
    qs = q.view(num_seqs, seq_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = median_ms(lambda: sdpa(qs, k, v, is_causal=True, scale=scale))
    ours = paged_attention(q, k_cache, v_cache, table, seq_lens, starts, scale).float()
    theirs = sdpa(qs, k, v, is_causal=True, scale=scale).transpose(1, 2).reshape_as(q).float()
    flops = 2 * num_seqs * NUM_HEADS * seq_len * seq_len * HEAD_DIM  # causal: half of 4*L*L*D
    first = paged_attention_ref(q[:seq_len], k_cache, v_cache, table[:1], seq_lens[:1],
                                starts[:2], scale).float()
    return {"seq_len": seq_len, "num_seqs": num_seqs, "ms": ms, "tflops": flops / ms / 1e9,
            "sdpa_ms": sdpa_ms, "sdpa_tflops": flops / sdpa_ms / 1e9,
            "rel_err_vs_sdpa": ((ours - theirs).norm() / theirs.norm()).item(),
            "rel_err_vs_ref": ((ours[:seq_len] - first).norm() / first.norm()).item()}


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU; none is visible to torch.")
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"device copy bandwidth: {copy_gbps:.0f} GB/s")
    decode = []
    for batch, ctx in DECODE_SHAPES:
        row = bench_decode(batch, ctx, copy_gbps)
        torch.cuda.empty_cache()
        if row is None:
            print(f"decode batch {batch} ctx {ctx}: skipped, does not fit in memory")
            continue
        decode.append(row)
        cells = "  ".join(f"{k} {row[k]['ms']:.3f} ms {row[k]['gbps']:.0f} GB/s "
                          f"{100 * row[k]['frac_of_copy']:.0f}%"
                          for k in ("auto", "unsplit", "split4"))
        print(f"decode batch {batch:3d} ctx {ctx:5d}: {cells}")
    prefill = []
    for seq_len in PREFILL_LENS:
        row = bench_prefill(seq_len)
        torch.cuda.empty_cache()
        prefill.append(row)
        print(f"prefill {row['num_seqs']} x {seq_len}: ours {row['tflops']:.0f} TFLOP/s "
              f"({row['ms']:.3f} ms), SDPA {row['sdpa_tflops']:.0f} TFLOP/s "
              f"({row['sdpa_ms']:.3f} ms), rel err vs SDPA {row['rel_err_vs_sdpa']:.1e}")
    print(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                      "gpu": torch.cuda.get_device_name(), "copy_gbps": copy_gbps,
                      "decode": decode, "prefill": prefill}))


if __name__ == "__main__":
    main()
