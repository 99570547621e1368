"""Kernel benchmark on one GPU: copy bandwidth, decode-attention bandwidth, prefill TFLOP/s.

Run as `python -m pagedserve.bench.kernels`; prints a table, then one JSON line with every number.
`--prefill-sweep` instead times every prefill tiling of SWEEP_VARIANTS at 1k, 4k and 16k tokens
per sequence, after checking each against SDPA's output. Prefill rows time SDPA twice: "sdpa" in
torch's default dispatch (on an H200 it may pick cuDNN attention; the bar) and "sdpa_flash"
forced to FlashAttention-2. `--window` instead times decode and prefill under a 4k sliding window
over a 32k context, and with a logit soft cap.
Shapes are Llama-3.1-8B attention: 32 query heads, 8 KV heads, head_dim 128, bf16, block size 16.
"""
import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedserve.bench import timing
from pagedserve.kernels.attention import AttentionConfig, default_config, paged_attention
from pagedserve.kernels.reference import FP8_DTYPE, paged_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_SHAPES = [(b, c) for b in (64, 256) for c in (1024, 4096, 16384)] + [(8, 16384)]
PREFILL_LENS = [1024, 4096, 16384]
# Tokens per prefill launch: whole prompts of one length (one prompt when it is longer).
PREFILL_TOKENS = 8192
SCALE = HEAD_DIM ** -0.5
REF_TOKENS = 2048
SWEEP_LENS = [1024, 4096, 16384]
SWEEP_MAX_ABS_ERR = 2e-2
WINDOW, WINDOW_CTX, WINDOW_PREFILL, SOFTCAP = 4096, 32768, 16384, 50.0
# Prefill tilings for --prefill-sweep: (BLOCK_M rows = query positions x GQA group of 4, KV
# tokens per step, warps, stages). "baseline" is the tiling and order before the sweep existed;
# "fresh" variants read the prompts' keys and values from k_new / v_new through TMA.
SWEEP_VARIANTS = {
    "baseline": AttentionConfig(128, 64, 8, 3),
    "rev": AttentionConfig(128, 64, 8, 3, reverse=True),
    "rev_s2": AttentionConfig(128, 64, 8, 2, reverse=True),
    "rev_s4": AttentionConfig(128, 64, 8, 4, reverse=True),
    "rev_w4": AttentionConfig(128, 64, 4, 3, reverse=True),
    "rev_n128": AttentionConfig(128, 128, 8, 3, reverse=True),
    "rev_n128_s2": AttentionConfig(128, 128, 8, 2, reverse=True),
    "rev_m64": AttentionConfig(64, 64, 4, 3, reverse=True),
    "rev_m64_n128": AttentionConfig(64, 128, 4, 3, reverse=True),
    "rev_m256_w8": AttentionConfig(256, 64, 8, 2, reverse=True),
    "lazy": AttentionConfig(128, 64, 8, 3, reverse=True, lazy_rescale=True),
    "lazy_s4": AttentionConfig(128, 64, 8, 4, reverse=True, lazy_rescale=True),
    "lazy_n128": AttentionConfig(128, 128, 8, 3, reverse=True, lazy_rescale=True),
    "lazy_n128_s2": AttentionConfig(128, 128, 8, 2, reverse=True, lazy_rescale=True),
    "fresh": AttentionConfig(128, 64, 8, 3, reverse=True, fresh_kv=True),
    "fresh_s4": AttentionConfig(128, 64, 8, 4, reverse=True, fresh_kv=True),
    "fresh_n128": AttentionConfig(128, 128, 8, 3, reverse=True, fresh_kv=True),
    "fresh_n128_s2": AttentionConfig(128, 128, 8, 2, reverse=True, fresh_kv=True),
    "fresh_m64_n128": AttentionConfig(64, 128, 4, 3, reverse=True, fresh_kv=True),
    "fresh_lazy_n128": AttentionConfig(128, 128, 8, 3, reverse=True, lazy_rescale=True,
                                       fresh_kv=True),
}


def median_ms(fn: Callable[[], object]) -> float:
    return timing.median_ms(fn, warmup_ms=25, rep_ms=200)


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
    if not fits(kv_bytes * 3 // 2):
        return None
    k_cache, v_cache, table = paged_kv(batch, ctx)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    row = {"batch": batch, "ctx": ctx, "kv_gb": kv_bytes / 1e9}
    ones = torch.ones((), device="cuda")
    fp8 = (k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE))
    # fp8kv: the same step over an fp8 cache, half the bytes (its GB/s counts the bytes read).
    for name, splits, caches, nbytes in (("auto", None, (k_cache, v_cache), kv_bytes),
                                         ("unsplit", 1, (k_cache, v_cache), kv_bytes),
                                         ("split4", 4, (k_cache, v_cache), kv_bytes),
                                         ("fp8kv", None, fp8, kv_bytes // 2)):
        ms = median_ms(lambda: paged_attention(q, *caches, table, seq_lens, starts, SCALE,
                                               max_query_len=1, max_seq_len=ctx,
                                               num_splits=splits, kv_scales=(ones, ones)))
        gbps = nbytes / ms / 1e6
        row[name] = {"ms": ms, "gbps": gbps, "frac_of_copy": gbps / copy_gbps}
    return row


@dataclass(slots=True)
class PrefillCase:
    """One prefill launch: num_seqs whole prompts of seq_len tokens on a paged cache, the same
    keys and values as the step's k_new / v_new, and contiguous, K/V expanded to every query
    head, for SDPA."""
    seq_len: int
    num_seqs: int
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor
    starts: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    sdpa_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    @property
    def flops(self) -> float:
        return 2 * self.num_seqs * NUM_HEADS * self.seq_len * self.seq_len * HEAD_DIM  # causal: half of 4*L*L*D

    def ours(self, **options: object) -> torch.Tensor:
        return paged_attention(self.q, self.k_cache, self.v_cache, self.table, self.seq_lens,
                               self.starts, SCALE, max_query_len=self.seq_len,
                               max_seq_len=self.seq_len, k_new=self.k_new, v_new=self.v_new,
                               **options)

    def sdpa(self) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(*self.sdpa_args, is_causal=True,
                                                               scale=SCALE)
        return out.transpose(1, 2).reshape_as(self.q)

    def sdpa_flash(self) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return self.sdpa()

    def sdpa_timings(self) -> dict:
        """ms and TFLOP/s of SDPA in the default dispatch ("sdpa") and forced to FA2."""
        row = {}
        for name, fn in (("sdpa", self.sdpa), ("sdpa_flash", self.sdpa_flash)):
            ms = median_ms(fn)
            row.update({f"{name}_ms": ms, f"{name}_tflops": self.flops / ms / 1e9})
        return row


def prefill_case(seq_len: int) -> PrefillCase:
    num_seqs = max(1, PREFILL_TOKENS // seq_len)
    k_cache, v_cache, table = paged_kv(num_seqs, seq_len)
    q = torch.randn(num_seqs * seq_len, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * seq_len
    group = NUM_HEADS // NUM_KV_HEADS
    k_new, v_new = (c[table.long()].reshape(num_seqs * seq_len, NUM_KV_HEADS, HEAD_DIM)
                    for c in (k_cache, v_cache))
    k, v = (x.view(num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM).repeat_interleave(group, dim=2)
            .transpose(1, 2).contiguous() for x in (k_new, v_new))
    qs = q.view(num_seqs, seq_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    return PrefillCase(seq_len, num_seqs, q, k_cache, v_cache, table, seq_lens, starts, k_new,
                       v_new, (qs, k, v))


def bench_prefill(seq_len: int) -> dict:
    case = prefill_case(seq_len)
    ms = median_ms(case.ours)
    ours, theirs = case.ours().float(), case.sdpa().float()
    # Causal: the first n queries see only the first n keys, so a prefix of the first prompt
    # keeps the reference's [heads, n, n] scores small.
    n = min(seq_len, REF_TOKENS)
    first = paged_attention_ref(case.q[:n], case.k_cache, case.v_cache, case.table[:1],
                                torch.full_like(case.seq_lens[:1], n),
                                torch.tensor([0, n], dtype=torch.int32, device="cuda"), SCALE).float()
    return {"seq_len": seq_len, "num_seqs": case.num_seqs, "ms": ms,
            "tflops": case.flops / ms / 1e9, **case.sdpa_timings(),
            "rel_err_vs_sdpa": ((ours - theirs).norm() / theirs.norm()).item(),
            "rel_err_vs_ref": ((ours[:n] - first).norm() / first.norm()).item()}


def sweep_variant(case: PrefillCase, expected: torch.Tensor, config: AttentionConfig,
                  fp8: bool) -> dict:
    """One tiling on one case: its max abs error against SDPA, then (if within
    SWEEP_MAX_ABS_ERR) its time; a tiling that fails to compile or launch reports why."""
    options: dict = {"config": config}
    if fp8:
        ones = torch.ones((), device="cuda")
        options["kv_scales"] = (ones, ones)
        case = replace(case, k_cache=case.k_cache.to(FP8_DTYPE), v_cache=case.v_cache.to(FP8_DTYPE))
    try:
        err = (case.ours(**options).float() - expected).abs().max().item()
    except Exception as failure:  # a tiling the compiler or the GPU refuses: report, go on
        return {"error": f"{type(failure).__name__}: {str(failure).splitlines()[0][:200]}"}
    row = {"max_abs_err": err}
    # fp8 K/V are not the data SDPA saw: its error is reported, not held to the bf16 bound.
    if err <= SWEEP_MAX_ABS_ERR or fp8:
        ms = median_ms(lambda: case.ours(**options))
        row.update(ms=ms, tflops=case.flops / ms / 1e9)
    return row


def prefill_sweep() -> list[dict]:
    """Every tiling of SWEEP_VARIANTS (and the default on an fp8 cache) at each SWEEP_LENS."""
    rows = []
    for seq_len in SWEEP_LENS:
        case = prefill_case(seq_len)
        expected = case.sdpa().float()
        row = {"seq_len": seq_len, "num_seqs": case.num_seqs, **case.sdpa_timings(),
               "variants": {}}
        print(f"prefill {case.num_seqs} x {seq_len}: {_sdpa_cells(row)}")
        default = default_config(NUM_HEADS // NUM_KV_HEADS, HEAD_DIM, 2, seq_len, fresh_kv=True)
        variants = [*SWEEP_VARIANTS.items(), ("default", default), ("default+fp8kv", default)]
        for name, config in variants:
            result = sweep_variant(case, expected, config, fp8=name.endswith("fp8kv"))
            row["variants"][name] = {**asdict(config), **result}
            print(f"  {name:16s} {_sweep_cell(result, row['sdpa_tflops'])}")
        rows.append(row)
        del case, expected
        torch.cuda.empty_cache()
    return rows


def _sdpa_cells(row: dict) -> str:
    return (f"SDPA {row['sdpa_tflops']:.0f} TFLOP/s ({row['sdpa_ms']:.3f} ms), FA2-forced "
            f"{row['sdpa_flash_tflops']:.0f} TFLOP/s ({row['sdpa_flash_ms']:.3f} ms)")


def _sweep_cell(result: dict, sdpa_tflops: float) -> str:
    if "error" in result:
        return f"failed: {result['error']}"
    if "tflops" not in result:
        return f"WRONG: max abs err {result['max_abs_err']:.2e} vs SDPA, not timed"
    return (f"{result['tflops']:4.0f} TFLOP/s ({100 * result['tflops'] / sdpa_tflops:3.0f}% of SDPA, "
            f"{result['ms']:.3f} ms), max abs err {result['max_abs_err']:.1e}")


def bench_window() -> list[dict]:
    """Decode (batch 8 and 64) and a 16k-token prefill under a 4k sliding window over a 32k
    context, beside the same steps unwindowed over 32k and over 4k (the bar: a windowed step
    reads only its window's tiles), and soft-capped over 4k."""
    rows = []
    for batch in (8, 64):
        k_cache, v_cache, table = paged_kv(batch, WINDOW_CTX)
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

        def step_ms(ctx: int, **options: object) -> float:
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            return median_ms(lambda: paged_attention(q, k_cache, v_cache, table, lens, starts,
                                                     SCALE, max_query_len=1, max_seq_len=ctx,
                                                     **options))

        rows.append({"step": f"decode {batch} x 32k", "full_ms": step_ms(WINDOW_CTX),
                     "window_ms": step_ms(WINDOW_CTX, sliding_window=WINDOW),
                     "ctx_4k_ms": step_ms(WINDOW),
                     "ctx_4k_softcap_ms": step_ms(WINDOW, softcap=SOFTCAP)})
        del k_cache, v_cache
        torch.cuda.empty_cache()
    case = prefill_case(WINDOW_PREFILL)
    rows.append({"step": f"prefill 1 x {WINDOW_PREFILL // 1024}k",
                 "full_ms": median_ms(case.ours),
                 "window_ms": median_ms(lambda: case.ours(sliding_window=WINDOW)),
                 "softcap_ms": median_ms(lambda: case.ours(softcap=SOFTCAP))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="time every prefill tiling against SDPA instead of the standard table")
    parser.add_argument("--window", action="store_true",
                        help="time sliding-window and soft-capped attention instead")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU; none is visible to torch.")
    torch.manual_seed(0)
    if args.prefill_sweep:
        rows = prefill_sweep()
        print(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                          "gpu": torch.cuda.get_device_name(), "prefill_sweep": rows}))
        return
    if args.window:
        rows = bench_window()
        for row in rows:
            print(row["step"] + ": " + ", ".join(f"{k[:-3]} {v:.3f} ms" for k, v in row.items()
                                                 if k.endswith("_ms")))
        print(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                          "gpu": torch.cuda.get_device_name(), "window": rows}))
        return
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
                          for k in ("auto", "unsplit", "split4", "fp8kv"))
        print(f"decode batch {batch:3d} ctx {ctx:5d}: {cells}")
    prefill = []
    for seq_len in PREFILL_LENS:
        row = bench_prefill(seq_len)
        torch.cuda.empty_cache()
        prefill.append(row)
        print(f"prefill {row['num_seqs']} x {seq_len}: ours {row['tflops']:.0f} TFLOP/s "
              f"({row['ms']:.3f} ms, {100 * row['tflops'] / row['sdpa_tflops']:.0f}% of SDPA), "
              f"{_sdpa_cells(row)}, rel err vs SDPA {row['rel_err_vs_sdpa']:.1e}")
    print(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                      "gpu": torch.cuda.get_device_name(), "copy_gbps": copy_gbps,
                      "decode": decode, "prefill": prefill}))


if __name__ == "__main__":
    main()
