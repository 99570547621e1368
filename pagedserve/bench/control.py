"""`pagedserve bench control-path`: what one step costs without a model, so that the scheduler's CPU
time and the gRPC round trip to the executor can be measured apart from GPU work.

The scheduler core runs against a null worker, first in this process (scheduler CPU alone),
then through the real executor gRPC server over a Unix socket in a child process (adds the plan and
result encoding and the round trip)."""
import argparse
import gc
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial

import grpc

from pagedserve.bench import workload
from pagedserve.common import aio, service
from pagedserve.common.config import EngineConfig
from pagedserve.common.plan import ExecutorInfo, StepPlan, StepResult
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.executor_svc.null_worker import NullWorker, null_executor_info
from pagedserve.v1 import executor_pb2, executor_pb2_grpc
from pagedserve.scheduler_svc.engine_loop import StreamTransport
from pagedserve.scheduler_svc.request import Request, RequestDelta
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.scheduler_svc.step_loop import RunnerTransport, StepLoop, Transport


@dataclass(slots=True)
class PhaseTimes:
    """Nanoseconds per phase of each step at the full batch; phases a mode lacks stay empty."""
    schedule: list[int] = field(default_factory=list)
    update: list[int] = field(default_factory=list)
    scheduler_cpu: list[int] = field(default_factory=list)
    scheduler_thread_cpu: list[int] = field(default_factory=list)
    encode: list[int] = field(default_factory=list)
    round_trip: list[int] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    forward: list[int] = field(default_factory=list)
    idle: list[int] = field(default_factory=list)
    step: list[int] = field(default_factory=list)


def add_control_path_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("control-path", help="scheduler CPU and gRPC cost per step, with a null model")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--background", action="store_true",
                   help="every request is background (batch) work, to time the scheduler's background path")
    p.add_argument("--mode", choices=["both", "in-process", "grpc"], default="both")
    p.add_argument("--output-json", help="also write the result here")
    p.set_defaults(run=run_control_path)


def run_control_path(args: argparse.Namespace) -> None:
    result = dict(bench="control-path", num_requests=args.num_requests, input_len=args.input_len,
                  output_len=args.output_len, block_size=args.block_size,
                  enable_prefix_caching=args.enable_prefix_caching, background=args.background)
    if args.mode in ("both", "in-process"):
        result["in_process"] = measure(args, run_in_process)
    if args.mode in ("both", "grpc"):
        result["grpc"] = measure(args, run_over_grpc)
    print_table(result)
    print(json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


def build_scheduler(args: argparse.Namespace) -> tuple[Scheduler, ExecutorInfo]:
    """A scheduler holding every request of the workload, with a pool large enough that none waits."""
    max_model_len = args.input_len + args.output_len
    blocks_per_request = -(-max_model_len // args.block_size)
    info = null_executor_info(args.num_requests * blocks_per_request + 1, args.block_size, max_model_len,
                              max_num_seqs=args.num_requests,
                              max_num_batched_tokens=args.max_num_batched_tokens)
    config = EngineConfig(enable_prefix_caching=args.enable_prefix_caching)
    scheduler = Scheduler(config, info)
    work = workload.random(n=args.num_requests, input_len=args.input_len, output_len=args.output_len,
                           vocab=info.vocab_size)
    for i, (prompt, output_len) in enumerate(zip(work.prompts, work.output_lens)):
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        scheduler.add(Request(seq_id=i + 1, request_id=str(i), prompt_token_ids=prompt, sampling=params,
                              background=args.background))
    return scheduler, info


def measure(args: argparse.Namespace, run) -> dict:
    scheduler, info = build_scheduler(args)
    gc.freeze()  # as the scheduler server does once its block pool exists
    times = PhaseTimes()
    try:
        num_steps, seconds = run(scheduler, info, times, args.num_requests)
    finally:
        # Frozen objects outlive the interpreter's last collection; Triton's, still in cycles
        # then, make nanobind report them as leaks at exit.
        gc.unfreeze()
    summary = {name: summarize(values) for name, values in asdict(times).items() if values}
    return dict(steps=num_steps, seconds=round(seconds, 3), steps_per_s=round(num_steps / seconds, 1),
                full_batch_steps=len(times.step), us_per_step=summary,
                scheduler_stats=scheduler.stats.summary())


def summarize(values_ns: list[int]) -> dict:
    values = sorted(values_ns)
    return dict(mean=round(statistics.fmean(values) / 1000, 1),
                p50=round(values[len(values) // 2] / 1000, 1),
                p99=round(values[min(len(values) - 1, len(values) * 99 // 100)] / 1000, 1))


class TimedCall:
    """The executor's Run stream, noting when a plan, encoded, is written and when its reply is read."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.written = self.replied = 0

    async def write(self, message: executor_pb2.StepPlan) -> None:
        self.written = time.perf_counter_ns()
        await self.call.write(message)

    async def read(self) -> executor_pb2.StepResult:
        reply = await self.call.read()
        self.replied = time.perf_counter_ns()
        return reply


class PhaseTimer:
    """Wraps the step loop's transport to time each phase of a step, with one step in flight at
    a time (async scheduling off): schedule() ends as the plan reaches launch, update() as its
    outputs reach `delivered`, and the result of the one plan out is in hand when collect returns.
    Only steps at the full batch are recorded."""

    def __init__(self, transport: Transport, times: PhaseTimes, batch: int,
                 call: TimedCall | None = None) -> None:
        self.transport = transport
        self.times = times
        self.batch = batch
        self.call = call
        self.num_steps = 0
        self.plan: StepPlan | None = None
        self.result: StepResult | None = None
        # Clock and thread-CPU readings at the step's phase boundaries.
        self.scheduled = self.cpu_scheduled = self.collected = self.cpu_collected = 0
        self.step_started()

    def step_started(self) -> None:
        self.cpu_start, self.start = time.thread_time_ns(), time.perf_counter_ns()

    async def launch(self, plan: StepPlan) -> None:
        self.scheduled, self.cpu_scheduled = time.perf_counter_ns(), time.thread_time_ns()
        self.plan = plan
        await self.transport.launch(plan)

    async def collect(self) -> StepResult:
        self.result = await self.transport.collect()
        self.cpu_collected, self.collected = time.thread_time_ns(), time.perf_counter_ns()
        return self.result

    def delivered(self, outputs: list[RequestDelta]) -> None:
        updated, cpu_updated = time.perf_counter_ns(), time.thread_time_ns()
        self.num_steps += 1
        if len(self.plan.continuing) == self.batch:
            self._record(updated, cpu_updated)
        self.step_started()

    def _record(self, updated: int, cpu_updated: int) -> None:
        times, result = self.times, self.result
        schedule_ns, update_ns = self.scheduled - self.start, updated - self.collected
        times.schedule.append(schedule_ns)
        times.update.append(update_ns)
        times.scheduler_cpu.append(schedule_ns + update_ns)
        times.scheduler_thread_cpu.append(self.cpu_scheduled - self.cpu_start
                                          + cpu_updated - self.cpu_collected)
        times.forward.append(result.forward_ns)
        times.step.append(updated - self.start)
        call = self.call
        if call is not None:
            times.encode.append(call.written - self.scheduled)
            times.round_trip.append(call.replied - call.written)
            times.decode.append(self.collected - call.replied)
            if result.idle_ns:
                times.idle.append(result.idle_ns)


def run_in_process(scheduler: Scheduler, info: ExecutorInfo, times: PhaseTimes,
                   batch: int) -> tuple[int, float]:
    timer = PhaseTimer(RunnerTransport(NullWorker(info)), times, batch)
    start = time.perf_counter()
    StepLoop(scheduler, async_scheduling=False).run_sync(timer, timer.delivered)
    return timer.num_steps, time.perf_counter() - start


def run_over_grpc(scheduler: Scheduler, info: ExecutorInfo, times: PhaseTimes,
                  batch: int) -> tuple[int, float]:
    with tempfile.TemporaryDirectory() as tmp:
        address = f"unix://{os.path.join(tmp, 'executor.sock')}"
        # spawn: the child must not inherit this process's gRPC state.
        child = multiprocessing.get_context("spawn").Process(
            target=serve_null_executor, args=(address, info), daemon=True)
        child.start()
        try:
            return aio.run(drive(scheduler, address, times, batch))
        finally:
            child.terminate()
            child.join()


async def drive(scheduler: Scheduler, address: str, times: PhaseTimes, batch: int) -> tuple[int, float]:
    async with service.channel(address) as channel:
        await service.wait_serving(address, timeout=60)
        call = executor_pb2_grpc.ExecutorStub(channel).Run(metadata=service.call_metadata())
        timed_call = TimedCall(call)
        timer = PhaseTimer(StreamTransport(timed_call), times, batch, timed_call)
        start = time.perf_counter()
        await StepLoop(scheduler, async_scheduling=False).run(timer, timer.delivered)
        seconds = time.perf_counter() - start
        await call.done_writing()
    return timer.num_steps, seconds


def serve_null_executor(address: str, info: ExecutorInfo) -> None:
    aio.run(_serve_null_executor(address, NullWorker(info)))


async def _serve_null_executor(address: str, worker: NullWorker) -> None:
    # Imported here: the executor server pulls in torch, which only the child needs.
    from pagedserve.executor_svc.server import ExecutorService
    running = await service.start("null executor", address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(worker)))
    await service.wait_for_signal()
    await running.stop()


ROWS = [("schedule", "schedule()"), ("update", "update()"), ("scheduler_cpu", "scheduler wall"),
        ("scheduler_thread_cpu", "scheduler thread CPU"),
        ("encode", "plan_to_proto"), ("round_trip", "gRPC round trip"), ("decode", "result_from_proto"),
        ("forward", "null forward"), ("idle", "executor idle"), ("step", "whole step")]


def print_table(result: dict) -> None:
    modes = [m for m in ("in_process", "grpc") if m in result]
    print(f"control path: {result['num_requests']} requests, prompt {result['input_len']}, "
          f"output {result['output_len']}, block {result['block_size']}, "
          f"prefix caching {'on' if result['enable_prefix_caching'] else 'off'}"
          + (", all background" if result["background"] else ""))
    print(f"{'':22}" + "".join(f"{m:>26}" for m in modes))
    print(f"{'steps/s':22}" + "".join(f"{result[m]['steps_per_s']:>26.1f}" for m in modes))
    print(f"{'us per step (full batch)':22}" + "".join(f"{'mean / p50 / p99':>26}" for m in modes))
    for key, label in ROWS:
        cells = []
        for m in modes:
            s = result[m]["us_per_step"].get(key)
            cells.append(f"{s['mean']:>8.1f} /{s['p50']:>7.1f} /{s['p99']:>7.1f}" if s else f"{'-':>26}")
        if any(c.strip() != "-" for c in cells):
            print(f"{label:22}" + "".join(f"{c:>26}" for c in cells))
