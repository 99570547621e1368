"""`pagedserve bench throughput` (offline throughput of the LLM API on a seeded workload) and
`pagedserve bench latency` (the decode step time of one fixed batch)."""
import argparse
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np

from pagedserve import bench_control, bench_serve, workload
from pagedserve.config import add_engine_args, config_from_args
from pagedserve.model_shapes import SHAPES, write_shape


@dataclass(slots=True)
class StepTimes:
    """Wall time of each engine step's parts, recorded by wrapping the cores' methods."""
    schedule_ns: list[int] = field(default_factory=list)
    run_ns: list[int] = field(default_factory=list)
    update_ns: list[int] = field(default_factory=list)
    run_start_ns: list[int] = field(default_factory=list)
    is_decode: list[bool] = field(default_factory=list)

    def attach(self, llm) -> None:
        llm.scheduler.schedule = self._timed(llm.scheduler.schedule, self.schedule_ns)
        llm.scheduler.update = self._timed(llm.scheduler.update, self.update_ns)
        run = self._timed(llm.runner.run, self.run_ns)

        def run_step(plan):
            self.run_start_ns.append(time.perf_counter_ns())
            self.is_decode.append(not plan.new_requests and all(
                r.num_scheduled_tokens == 1 for r in plan.continuing))
            return run(plan)
        llm.runner.run = run_step

    def clear(self) -> None:
        for times in (self.schedule_ns, self.run_ns, self.update_ns, self.run_start_ns,
                      self.is_decode):
            times.clear()

    @staticmethod
    def _timed(fn: Callable, into: list[int]) -> Callable:
        def timed(*args):
            start = time.perf_counter_ns()
            out = fn(*args)
            into.append(time.perf_counter_ns() - start)
            return out
        return timed

    def decode_run_ms(self) -> np.ndarray:
        return np.array(self.run_ns)[np.array(self.is_decode, dtype=bool)] / 1e6

    def decode_interval_ms(self) -> np.ndarray:
        """Start-to-start time of consecutive decode steps: the step with scheduling included."""
        starts, decode = np.array(self.run_start_ns), np.array(self.is_decode, dtype=bool)
        both = decode[1:] & decode[:-1]
        return np.diff(starts)[both] / 1e6


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    tp = sub.add_parser("throughput", help="offline throughput on a seeded workload")
    _add_model_args(tp)
    tp.add_argument("--dataset", choices=["mixed", "random"], default="mixed")
    tp.add_argument("--num-prompts", type=int, default=512)
    tp.add_argument("--input-len", type=int, default=1024, help="random dataset only")
    tp.add_argument("--output-len", type=int, default=1024, help="random dataset only")
    tp.add_argument("--dataset-seed", type=int, default=0)
    tp.add_argument("--output-json", help="also write the result here")
    add_engine_args(tp)
    tp.set_defaults(run=run_throughput)
    bench_serve.add_serve_args(sub)
    bench_control.add_control_path_args(sub)

    lat = sub.add_parser("latency", help="mean decode step time of one fixed batch")
    _add_model_args(lat)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=3, help="timed generate calls")
    lat.add_argument("--output-json", help="also write the result here")
    add_engine_args(lat)
    lat.set_defaults(run=run_latency)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a Hugging Face model directory")
    source.add_argument("--model-config", choices=sorted(SHAPES),
                        help="a named model shape (use with --load-format dummy)")


def _make_llm(args: argparse.Namespace):
    from pagedserve.llm import LLM
    args.model = args.model or write_shape(args.model_config)
    config = config_from_args(args)
    return LLM(**{k: getattr(config, k) for k in config.__slots__})


def run_throughput(args: argparse.Namespace) -> None:
    from pagedserve.sampling_params import SamplingParams

    llm = _make_llm(args)
    vocab = min(32000, llm.runner.describe().vocab_size)
    if args.dataset == "mixed":
        work = workload.mixed(n=args.num_prompts, seed=args.dataset_seed, vocab=vocab)
    else:
        work = workload.random(n=args.num_prompts, input_len=args.input_len,
                               output_len=args.output_len, seed=args.dataset_seed, vocab=vocab)
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in work.output_lens]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # compile kernels, warm the allocator
    times = StepTimes()
    times.attach(llm)
    stats = llm.runner.stats
    stats.steps = stats.total_ns = stats.wait_ns = 0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    if generated != work.output_tokens:
        raise SystemExit(f"bench: generated {generated} tokens, expected {work.output_tokens}")
    steps = len(times.run_ns)
    decode = times.decode_run_ms()
    result = dict(bench="throughput", dataset=args.dataset, num_prompts=len(prompts),
                  prompt_tokens=work.prompt_tokens, output_tokens=work.output_tokens,
                  seconds=round(seconds, 3),
                  output_tokens_per_s=round(work.output_tokens / seconds, 1),
                  total_tokens_per_s=round((work.prompt_tokens + work.output_tokens) / seconds, 1),
                  steps=steps, decode_steps=len(decode),
                  schedule_s=round(sum(times.schedule_ns) / 1e9, 3),
                  update_s=round(sum(times.update_ns) / 1e9, 3),
                  run_s=round(sum(times.run_ns) / 1e9, 3),
                  run_device_wait_s=round(stats.wait_ns / 1e9, 3),
                  decode_run_s=round(decode.sum() / 1e3, 3),
                  model=args.model_config or args.model, **environment())
    print(f"useful output tokens/s: {result['output_tokens_per_s']:.1f}")
    print(f"total tokens/s:         {result['total_tokens_per_s']:.1f}")
    print(f"seconds:                {result['seconds']:.2f}")
    print(f"steps: {steps} ({len(decode)} pure decode); host time: schedule "
          f"{result['schedule_s']} s, update {result['update_s']} s, runner.run {result['run_s']} s "
          f"of which blocked on the device {result['run_device_wait_s']} s")
    _emit(result, args.output_json)


def run_latency(args: argparse.Namespace) -> None:
    from pagedserve.sampling_params import SamplingParams

    llm = _make_llm(args)
    vocab = min(32000, llm.runner.describe().vocab_size)
    work = workload.random(n=args.batch_size, input_len=args.input_len,
                           output_len=args.output_len, vocab=vocab)
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    times = StepTimes()
    times.attach(llm)
    stats = llm.runner.stats
    stats.steps = stats.total_ns = stats.wait_ns = 0
    for _ in range(args.num_iters):
        llm.generate(prompts, params, use_tqdm=False)
    run_ms, interval_ms = times.decode_run_ms(), times.decode_interval_ms()
    host_ms = (stats.total_ns - stats.wait_ns) / stats.steps / 1e6
    result = dict(bench="latency", batch_size=args.batch_size, input_len=args.input_len,
                  output_len=args.output_len, decode_steps=len(run_ms),
                  decode_step_ms_mean=round(float(run_ms.mean()), 3),
                  decode_step_ms_median=round(float(np.median(run_ms)), 3),
                  decode_interval_ms_mean=round(float(interval_ms.mean()), 3),
                  step_host_ms=round(host_ms, 3),
                  step_device_wait_ms=round(stats.wait_ns / stats.steps / 1e6, 3),
                  cuda_graphs=bool(llm.runner.graphs.graphs),
                  model=args.model_config or args.model, **environment())
    print(f"mean decode step:   {result['decode_step_ms_mean']:.3f} ms "
          f"(median {result['decode_step_ms_median']:.3f} ms; prepare + forward + sample + sync, "
          f"{len(run_ms)} steps, CUDA graphs {'on' if result['cuda_graphs'] else 'off'})")
    print(f"mean step interval: {result['decode_interval_ms_mean']:.3f} ms (with scheduling)")
    print(f"per step (all steps): {result['step_host_ms']:.3f} ms on the host in runner.run "
          f"(device idle unless the previous step's work is still queued), "
          f"{result['step_device_wait_ms']:.3f} ms blocked on the device")
    _emit(result, args.output_json)


def _emit(result: dict, path: str | None) -> None:
    print(json.dumps(result))
    if path:
        with open(path, "w") as f:
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
