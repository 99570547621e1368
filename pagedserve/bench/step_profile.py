"""Where a decode step's device time goes, by kind of kernel: `pagedserve bench latency --profile`.

One more generate of the benchmark's batch runs under torch's profiler (CUDA kernels, those
replayed from CUDA graphs included). Its kernels are cut into steps after each step's last
sampling kernel; the decode steps (all but the prefill, and the first and last few, whose
neighbours overlap them) are summed by kind, and each figure is the median over those steps, in
us: a kind's kernel time, the step's span (first kernel start to last kernel end), the idle gaps
between its kernels, and the time that programmatic dependent launch overlaps."""
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

# (kind, a substring of the kernel's name, lower case), the first match winning.
KINDS = (("attention", "_attention_kernel"), ("attention merge", "_merge_kernel"),
         ("rms norm", "rms_norm"), ("rotary + kv write", "rotary"), ("gated activation", "_gated"),
         ("sampling", "argmax"), ("gemm split-k sum", "splitkreduce"), ("gemm", "gemm"),
         ("gemm", "nvjet"), ("gemm", "cutlass"), ("gemm", "xmma"), ("gemm", "gemv"),
         ("gemm", "_small_batch"))
# A step's last kernel: the argmax reduction over its rows' chunks (kernels/argmax.py).
STEP_END = "reduce_argmax"
# Steps at either end of the run that the prefill or the run's end may overlap.
EDGE_STEPS = 2


@dataclass(slots=True)
class Kernel:
    name: str
    start_us: float
    end_us: float


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, part in KINDS if part in low), "other")


def split_steps(kernels: Iterable[Kernel]) -> list[list[Kernel]]:
    """Kernels in start order, cut after each step's STEP_END kernel."""
    steps, step = [], []
    for kernel in sorted(kernels, key=lambda k: k.start_us):
        step.append(kernel)
        if STEP_END in kernel.name.lower():
            steps.append(step)
            step = []
    return steps


def summarize(step: list[Kernel]) -> dict[str, float]:
    """One step's kernel time by kind, its span, gaps, PDL overlap and kernel count."""
    out = {"span": step[-1].end_us - step[0].start_us, "gaps": 0.0, "overlap": 0.0,
           "kernels": float(len(step))}
    for kernel in step:
        name = kind(kernel.name)
        out[name] = out.get(name, 0.0) + kernel.end_us - kernel.start_us
    for before, after in zip(step, step[1:]):
        between = after.start_us - before.end_us
        out["gaps" if between > 0 else "overlap"] += abs(between)
    return out


def decode_medians(steps: list[list[Kernel]]) -> dict[str, float]:
    """The median of each figure over the decode steps: the steps after the first (the prefill),
    less EDGE_STEPS at either end."""
    decode = [summarize(step) for step in steps[1 + EDGE_STEPS:len(steps) - EDGE_STEPS]]
    if not decode:
        raise ValueError(f"the profiled run has {len(steps)} steps; it needs more than "
                         f"{1 + 2 * EDGE_STEPS}: raise --output-len")
    names = sorted({name for summary in decode for name in summary})
    return {name: round(statistics.median(s.get(name, 0.0) for s in decode), 1) for name in names}


def profile_decode(llm, prompts: list[dict], params) -> dict[str, float]:
    """decode_medians of one llm.generate(prompts, params) under torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    return decode_medians(split_steps(cuda_kernels(prof)))


def cuda_kernels(prof) -> list[Kernel]:
    """The GPU kernels a torch.profiler.profile recorded, less its memory copies and sets."""
    import torch

    return [Kernel(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Mem")]


def table(medians: dict[str, float]) -> str:
    rows = sorted(medians.items(), key=lambda item: -item[1])
    return "\n".join(f"  {name:20s} {value:10.1f}" for name, value in rows)
