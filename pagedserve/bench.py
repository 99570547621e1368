"""`pagedserve bench throughput`: offline throughput of the LLM API on a seeded workload."""
import argparse
import json
import subprocess
import time
from datetime import datetime, timezone

from pagedserve import workload
from pagedserve.config import add_engine_args, config_from_args
from pagedserve.model_shapes import SHAPES, write_shape


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    tp = sub.add_parser("throughput", help="offline throughput on a seeded workload")
    source = tp.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a Hugging Face model directory")
    source.add_argument("--model-config", choices=sorted(SHAPES),
                        help="a named model shape (use with --load-format dummy)")
    tp.add_argument("--dataset", choices=["mixed", "random"], default="mixed")
    tp.add_argument("--num-prompts", type=int, default=512)
    tp.add_argument("--input-len", type=int, default=1024, help="random dataset only")
    tp.add_argument("--output-len", type=int, default=1024, help="random dataset only")
    tp.add_argument("--dataset-seed", type=int, default=0)
    tp.add_argument("--output-json", help="also write the result here")
    add_engine_args(tp)
    tp.set_defaults(run=run_throughput)


def run_throughput(args: argparse.Namespace) -> None:
    from pagedserve.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    args.model = args.model or write_shape(args.model_config)
    config = config_from_args(args)
    llm = LLM(**{k: getattr(config, k) for k in config.__slots__})
    vocab = min(32000, llm.runner.describe().vocab_size)
    if args.dataset == "mixed":
        work = workload.mixed(n=args.num_prompts, seed=args.dataset_seed, vocab=vocab)
    else:
        work = workload.random(n=args.num_prompts, input_len=args.input_len,
                               output_len=args.output_len, seed=args.dataset_seed, vocab=vocab)
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in work.output_lens]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # compile kernels, warm the allocator
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    if generated != work.output_tokens:
        raise SystemExit(f"bench: generated {generated} tokens, expected {work.output_tokens}")
    result = dict(bench="throughput", dataset=args.dataset, num_prompts=len(prompts),
                  prompt_tokens=work.prompt_tokens, output_tokens=work.output_tokens,
                  seconds=round(seconds, 3),
                  output_tokens_per_s=round(work.output_tokens / seconds, 1),
                  total_tokens_per_s=round((work.prompt_tokens + work.output_tokens) / seconds, 1),
                  model=args.model_config or args.model, **environment())
    print(f"useful output tokens/s: {result['output_tokens_per_s']:.1f}")
    print(f"total tokens/s:         {result['total_tokens_per_s']:.1f}")
    print(f"seconds:                {result['seconds']:.2f}")
    print(json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


def environment() -> dict:
    """Date, device, versions and commit: what every recorded benchmark figure states."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, triton=triton_version, commit=commit)
