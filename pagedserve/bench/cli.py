"""`pagedserve bench throughput` (offline throughput of the LLM API on a seeded workload) and
`pagedserve bench latency` (the decode step time of one fixed batch)."""
import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pagedserve.bench import (batch as bench_batch, control as bench_control, serve as bench_serve, step_profile,
                              workload)
from pagedserve.common.config import add_engine_args, config_from_args
from pagedserve.common.model_shapes import SHAPES, write_shape

WARM_UP_REQUESTS = 8


@dataclass(slots=True)
class EngineCallTimes:
    """Host wall time of the engine's calls in each step, recorded by wrapping the cores' methods."""
    schedule_ns: list[int] = field(default_factory=list)
    update_ns: list[int] = field(default_factory=list)
    launch_ns: list[int] = field(default_factory=list)
    collect_ns: list[int] = field(default_factory=list)
    launch_start_ns: list[int] = field(default_factory=list)
    is_decode: list[bool] = field(default_factory=list)

    def attach(self, llm) -> None:
        llm.scheduler.schedule = self._timed(llm.scheduler.schedule, self.schedule_ns)
        llm.scheduler.update = self._timed(llm.scheduler.update, self.update_ns)
        llm.worker.collect = self._timed(llm.worker.collect, self.collect_ns)
        launch = self._timed(llm.worker.launch, self.launch_ns)

        def launch_step(plan):
            self.launch_start_ns.append(time.perf_counter_ns())
            self.is_decode.append(not plan.new_requests and all(
                r.num_scheduled_tokens == 1 for r in plan.continuing))
            return launch(plan)
        llm.worker.launch = launch_step

    @staticmethod
    def _timed(fn: Callable, into: list[int]) -> Callable:
        def timed(*args):
            start = time.perf_counter_ns()
            out = fn(*args)
            into.append(time.perf_counter_ns() - start)
            return out
        return timed

    def decode_interval_ms(self) -> np.ndarray:
        """Launch-to-launch time of consecutive decode steps: what a decode step costs in all."""
        starts, decode = np.array(self.launch_start_ns), np.array(self.is_decode, dtype=bool)
        both = decode[1:] & decode[:-1]
        return np.diff(starts)[both] / 1e6

    def seconds(self) -> dict:
        return {f"{name}_s": round(sum(getattr(self, f"{name}_ns")) / 1e9, 3)
                for name in ("schedule", "update", "launch", "collect")}


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
    tp.add_argument("--structured-fraction", type=float, default=0.0,
                    help="the share of requests under a JSON schema (structured outputs); needs a "
                         "model with a tokenizer, or --tokenizer for a --model-config shape")
    add_engine_args(tp)
    tp.set_defaults(run=run_throughput)
    bench_serve.add_serve_args(sub)
    bench_batch.add_batch_args(sub)
    bench_control.add_control_path_args(sub)

    lat = sub.add_parser("latency", help="mean decode step time of one fixed batch")
    _add_model_args(lat)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=3, help="timed generate calls")
    lat.add_argument("--output-json", help="also write the result here")
    lat.add_argument("--structured", action="store_true", help="every request under a JSON schema")
    lat.add_argument("--profile", action="store_true",
                     help="then one more run under torch's profiler: a decode step's device time by "
                          "kind of kernel (a CUDA GPU only)")
    add_engine_args(lat)
    lat.set_defaults(run=run_latency)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a Hugging Face model directory")
    source.add_argument("--model-config", choices=sorted(SHAPES),
                        help="a named model shape (use with --load-format dummy)")
    parser.add_argument("--tokenizer", help="a tokenizer directory or .gguf for a --model-config shape, "
                                            "whose own is a word list that cannot spell JSON")


def _make_llm(args: argparse.Namespace):
    from pagedserve.entrypoints.llm import LLM
    if not args.model:
        args.model = write_shape(args.model_config)
        if args.tokenizer:
            _copy_tokenizer(args.tokenizer, args.model)
    config = config_from_args(args)
    return LLM(**{k: getattr(config, k) for k in config.__slots__})


def _copy_tokenizer(source: str, model_dir: str) -> None:
    """Puts a tokenizer beside a shape's config, where the executor's grammar compiler finds it."""
    from pagedserve.common.tokenizer import Tokenizer
    Path(model_dir, "tokenizer.json").write_text(Tokenizer.load(source).to_json())


def structured(params, fraction: float) -> list:
    """Every round(1 / fraction)-th request put under BENCH_SCHEMA; lengths stay as they were
    (ignore_eos: a finished output goes on sampling EOS, which its grammar then allows alone)."""
    from pagedserve.common.sampling_params import StructuredOutputsParams
    if not fraction:
        return params
    every = round(1 / fraction)
    constraint = StructuredOutputsParams(json=BENCH_SCHEMA)
    return [replace(p, structured_outputs=constraint) if i % every == 0 else p for i, p in enumerate(params)]


# An open-ended list of records: a sampling model keeps its grammar busy for many tokens.
BENCH_SCHEMA = {"type": "array", "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "score", "tags"],
    "properties": {"name": {"type": "string"}, "score": {"type": "number"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}}


def run_throughput(args: argparse.Namespace) -> None:
    from pagedserve.common.sampling_params import SamplingParams

    llm = _make_llm(args)
    vocab = min(workload.VOCAB, llm.worker.describe().vocab_size)
    if args.dataset == "mixed":
        work = workload.mixed(n=args.num_prompts, seed=args.dataset_seed, vocab=vocab)
    else:
        work = workload.random(n=args.num_prompts, input_len=args.input_len,
                               output_len=args.output_len, seed=args.dataset_seed, vocab=vocab)
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = structured([SamplingParams(max_tokens=n, ignore_eos=True) for n in work.output_lens],
                        args.structured_fraction)
    warm_up(llm, prompts[:WARM_UP_REQUESTS], params[:WARM_UP_REQUESTS])
    times, stats = _attach_timers(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    if generated != work.output_tokens:
        raise SystemExit(f"bench: generated {generated} tokens, expected {work.output_tokens}")
    steps = len(times.launch_ns)
    result = dict(bench="throughput", dataset=args.dataset, num_prompts=len(prompts),
                  prompt_tokens=work.prompt_tokens, output_tokens=work.output_tokens,
                  seconds=round(seconds, 3),
                  output_tokens_per_s=round(work.output_tokens / seconds, 1),
                  total_tokens_per_s=round((work.prompt_tokens + work.output_tokens) / seconds, 1),
                  steps=steps, decode_steps=int(sum(times.is_decode)), **times.seconds(),
                  device_wait_s=round(stats.wait_ns / 1e9, 3),
                  device_step_s=round(stats.device_ns / 1e9, 3),
                  device_idle_s=round(stats.idle_ns / 1e9, 3),
                  async_scheduling=llm.config.async_scheduling, structured_fraction=args.structured_fraction,
                  model=args.model_config or args.model, quantization=llm.worker.quantization,
                  **environment())
    print(f"useful output tokens/s: {result['output_tokens_per_s']:.1f}")
    print(f"total tokens/s:         {result['total_tokens_per_s']:.1f}")
    print(f"seconds:                {result['seconds']:.2f}")
    print(f"steps: {steps} ({result['decode_steps']} pure decode); host time: schedule "
          f"{result['schedule_s']} s, update {result['update_s']} s, launch {result['launch_s']} s, "
          f"collect {result['collect_s']} s of which blocked on the device {result['device_wait_s']} s; "
          f"device time: steps {result['device_step_s']} s, idle between steps "
          f"{result['device_idle_s']} s")
    _emit(result, args.output_json)


def warm_up(llm, prompts: list[dict], params: list) -> None:
    """Runs a few requests first, so that the timed run pays for no kernel compilation or first
    allocation; says so, since on a GPU it can take a while."""
    print(f"warming up: {len(prompts)} requests (kernel compilation, allocator), not timed", flush=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    print(f"warm-up done in {time.perf_counter() - start:.1f} s", flush=True)


def _attach_timers(llm):
    """Times the engine's calls from here on; returns the timings (EngineCallTimes) and the runner's
    zeroed RunnerStats (imported here: the CLI must not pull in torch to parse arguments)."""
    from pagedserve.executor_svc.model_runner import RunnerStats
    times = EngineCallTimes()
    times.attach(llm)
    llm.worker.runner.stats = RunnerStats()
    return times, llm.worker.runner.stats


def run_latency(args: argparse.Namespace) -> None:
    from pagedserve.common.sampling_params import SamplingParams

    llm = _make_llm(args)
    if args.profile and llm.worker.device.type != "cuda":
        sys.exit("--profile times CUDA kernels, and this engine runs on the CPU; leave --profile out.")
    vocab = min(workload.VOCAB, llm.worker.describe().vocab_size)
    work = workload.random(n=args.batch_size, input_len=args.input_len,
                           output_len=args.output_len, vocab=vocab)
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = structured([SamplingParams(max_tokens=args.output_len, ignore_eos=True)],
                        1.0 if args.structured else 0.0)[0]
    llm.generate(prompts, params, use_tqdm=False)
    times, stats = _attach_timers(llm)
    for _ in range(args.num_iters):
        llm.generate(prompts, params, use_tqdm=False)
    interval_ms = times.decode_interval_ms()
    steps = stats.steps
    result = dict(bench="latency", batch_size=args.batch_size, input_len=args.input_len,
                  output_len=args.output_len, decode_steps=len(interval_ms),
                  decode_step_ms_mean=round(float(interval_ms.mean()), 3),
                  decode_step_ms_median=round(float(np.median(interval_ms)), 3),
                  device_step_ms=round(stats.device_ns / steps / 1e6, 3),
                  device_idle_ms=round(stats.idle_ns / steps / 1e6, 3),
                  host_step_ms=round(stats.host_ns / steps / 1e6, 3),
                  cuda_graphs=bool(llm.worker.runner.graphs.graphs),
                  async_scheduling=llm.config.async_scheduling, structured=args.structured,
                  model=args.model_config or args.model, quantization=llm.worker.quantization,
                  **environment())
    print(f"mean decode step:  {result['decode_step_ms_mean']:.3f} ms (median "
          f"{result['decode_step_ms_median']:.3f} ms; launch to launch of consecutive decode steps, "
          f"CUDA graphs {'on' if result['cuda_graphs'] else 'off'}, async scheduling "
          f"{'on' if result['async_scheduling'] else 'off'})")
    print(f"per step (all steps): {result['device_step_ms']:.3f} ms of device work, "
          f"{result['device_idle_ms']:.3f} ms device idle before it, "
          f"{result['host_step_ms']:.3f} ms host time in launch and collect")
    if args.profile:
        result["profile_us"] = step_profile.profile_decode(llm, prompts, params)
        print("a decode step's device time, median us (kernel time by kind, span, gaps, overlap):")
        print(step_profile.table(result["profile_us"]))
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
