"""Pooling throughput through the offline API: LLM.embed on the bge-m3 shape (XLM-R large) over
10,000 inputs of seeded lengths U[32, 512], and a 1,000-document rerank on the bge-reranker-v2-m3
shape (each pair a query of 32 tokens and a document of U[32, 512], as token ids through
LLM.classify, which LLM.score calls on a tokenized pair). Prints inputs/s, tokens/s and the share
of the GEMM roofline: 2 × (parameters of the linear layers) × tokens FLOPs, against the H200's
989 TFLOP/s of dense bf16 (attention's own FLOPs, small at these lengths, are not counted), and a
BENCHMARKS.md row per run.

    python -m pagedserve.bench.pooling --load-format dummy                       # the GPU figures
    python -m pagedserve.bench.pooling --load-format dummy --num-inputs 64 --num-docs 32 \\
        --shape-overrides '{"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                            "num_attention_heads": 4, "vocab_size": 1000}'    # a CPU check
"""
import argparse
import json
import time

from pagedserve.bench import workload
from pagedserve.bench.cli import environment
from pagedserve.common.model_shapes import SHAPES, write_shape

H200_BF16_DENSE_FLOPS = 989e12
QUERY_TOKENS = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embed-model-config", default="bge-m3", choices=sorted(SHAPES))
    parser.add_argument("--rerank-model-config", default="bge-reranker-v2-m3", choices=sorted(SHAPES))
    parser.add_argument("--shape-overrides", type=json.loads, default={},
                        help="JSON merged into both shapes' config.json (a tiny model for a CPU check)")
    parser.add_argument("--load-format", default="dummy", choices=["dummy", "auto"])
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 on a GPU; float32 on a CPU")
    parser.add_argument("--num-inputs", type=int, default=10_000)
    parser.add_argument("--num-docs", type=int, default=1_000)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    return parser.parse_args(argv)


def make_llm(args: argparse.Namespace, shape: str):
    import torch

    from pagedserve.entrypoints.llm import LLM
    path = write_shape(shape)
    with open(f"{path}/config.json") as f:
        config = {**json.load(f), **args.shape_overrides}
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    dtype = args.dtype if torch.cuda.is_available() else "float32"
    return LLM(path, load_format=args.load_format, dtype=dtype, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens)


def linear_params(llm) -> int:
    """Parameters of the model's linear layers: those whose every weight is used by every token."""
    from torch import nn
    return sum(m.weight.numel() for m in llm.worker.model.modules() if isinstance(m, nn.Linear))


def timed(run, prompts: list[dict]) -> float:
    run(prompts[:8], use_tqdm=False)  # kernel compilation and first allocations, not timed
    start = time.perf_counter()
    outputs = run(prompts, use_tqdm=False)
    seconds = time.perf_counter() - start
    if len(outputs) != len(prompts):
        raise SystemExit(f"bench: {len(outputs)} outputs for {len(prompts)} inputs")
    return seconds


def report(name: str, shape: str, llm, prompts: list[dict], seconds: float) -> dict:
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    flops = 2 * linear_params(llm) * tokens
    result = dict(bench=f"pooling-{name}", model=shape, inputs=len(prompts), tokens=tokens,
                  seconds=round(seconds, 3), inputs_per_s=round(len(prompts) / seconds, 1),
                  tokens_per_s=round(tokens / seconds, 1),
                  gemm_roofline_share=round(flops / seconds / H200_BF16_DENSE_FLOPS, 4),
                  max_num_seqs=llm.config.max_num_seqs, max_num_batched_tokens=llm.config.max_num_batched_tokens,
                  **environment())
    print(json.dumps(result))
    print(f"| {result['date']} | {result['device']} | {result['commit']} | {name} ({shape}) | {len(prompts):,} "
          f"| {result['inputs_per_s']:,} | {result['tokens_per_s']:,} | {100 * result['gemm_roofline_share']:.1f}% |")
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    embed_inputs = workload.mixed(n=args.num_inputs, in_lo=args.min_len, in_hi=args.max_len, seed=args.seed,
                                  vocab=min(workload.VOCAB, args.shape_overrides.get("vocab_size", workload.VOCAB)))
    llm = make_llm(args, args.embed_model_config)
    prompts = [{"prompt_token_ids": p} for p in embed_inputs.prompts]
    report("embed", args.embed_model_config, llm, prompts, timed(llm.embed, prompts))
    del llm
    docs = workload.mixed(n=args.num_docs + 1, in_lo=args.min_len, in_hi=args.max_len, seed=args.seed + 1,
                          vocab=min(workload.VOCAB, args.shape_overrides.get("vocab_size", workload.VOCAB)))
    query = docs.prompts[0][:QUERY_TOKENS]
    llm = make_llm(args, args.rerank_model_config)
    pairs = [{"prompt_token_ids": query + d} for d in docs.prompts[1:]]
    report("rerank", args.rerank_model_config, llm, pairs, timed(llm.classify, pairs))


if __name__ == "__main__":
    main()
