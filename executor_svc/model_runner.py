"""The model runner: turns a step plan (a delta) into one forward pass and one sampled token per
finished prefill or decode. It applies the plan to the persistent batch, builds and uploads the
step's inputs, runs the forward (a CUDA graph's replay or eagerly) and samples; steps are
pipelined, launched before the previous one's tokens reach the host (executor_svc/worker.py builds
it and drives it)."""
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.executor_svc.attention_backend import AttentionMetadata
from pagedserve.executor_svc.cuda_graphs import (CudaGraphs, GraphShape, GraphShapes, blas_library,
                                                capture_sizes, graph_metadata, mixed_capture_sizes,
                                                pads_mixed_steps)
from pagedserve.executor_svc.host_slots import HostSlot
from pagedserve.executor_svc.input_batch import InputBatch
from pagedserve.executor_svc.kv_cache import KVCache, allocate_kv_cache
from pagedserve.executor_svc.layers.decoder import CausalLM
from pagedserve.executor_svc.lora import LoraSlots
from pagedserve.executor_svc.logits import (PROMPT_LOGPROBS_CHUNK, LogprobRows, SampledLogprobs,
                                            chunked_logprobs, step_logprobs)
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.parallel import TensorParallel
from pagedserve.executor_svc.projection_rows import decode_sizes
from pagedserve.executor_svc.sampler import Sampler, SamplingBatch, make_sampling_batch
from pagedserve.executor_svc.sampling_inputs import PendingPrompt, SamplingInputs
from pagedserve.executor_svc.step_buffers import StepBuffers
from pagedserve.executor_svc.step_inputs import HostInputs, host_inputs
from pagedserve.executor_svc.step_clock import StepClock
from pagedserve.executor_svc.structured_outputs import StructuredOutputs
from pagedserve.common.config import EngineConfig
from pagedserve.common.plan import MAX_STEPS_IN_FLIGHT, NewRequest, RequestError, StepPlan, StepResult
from pagedserve.common.sampling_params import SamplingParams


@dataclass(slots=True)
class Step:
    """One step's device inputs (in the StepBuffers) and which of its sequences sample."""
    num_tokens: int
    meta: AttentionMetadata
    graph: GraphShape | None
    sample_rows: np.ndarray
    logits_indices: torch.Tensor | None  # see HostInputs


@dataclass(slots=True)
class Launched:
    """A step whose work is queued on the device; `collect` turns it into its StepResult."""
    step_id: int
    rows: np.ndarray     # batch rows of the sequences that sample, in plan order
    seq_ids: np.ndarray
    # On the host once the device passes `end` (device tensors on the CPU).
    tokens: torch.Tensor
    logprobs: SampledLogprobs | None
    asked: LogprobRows | None
    # Device marks around the step (None for a plan with nothing to compute), and the end mark
    # of the step before, for the idle gap.
    start: object = None
    end: object = None
    after: object = None
    # Whether its tokens are in the batch already (see ModelRunner._settle).
    applied: bool = False
    prompt: PendingPrompt | None = None
    # The seq_ids whose grammar was not ready (their tokens are void), and the requests failed.
    deferred: np.ndarray | None = None
    errors: list[RequestError] = field(default_factory=list)


@dataclass(slots=True)
class RunnerStats:
    """Running totals over steps: host time in launch and collect, time blocked on the device,
    and the device's own time per step and idle time between steps."""
    steps: int = 0
    host_ns: int = 0
    wait_ns: int = 0
    device_ns: int = 0
    idle_ns: int = 0


class ModelRunner:
    """Turns step plans into sampled tokens on `model`. Requests persist between plans, keyed by
    seq_id, in the persistent batch. The Worker builds it, sizes and hands it the KV cache
    (`kv_caches`), and captures its CUDA graphs; `tp` is this rank's group (None without tensor
    parallelism), over which the ranks take rank 0's sampled tokens."""

    def __init__(self, model: CausalLM, config: EngineConfig, model_config: ModelConfig,
                 max_model_len: int, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 tp: TensorParallel | None) -> None:
        self.model, self.config = model, config
        self.max_model_len, self.block_size = max_model_len, config.block_size
        self.device, self.kv_dtype, self.tp = device, kv_dtype, tp
        self.kv_caches: list[KVCache] = []
        self.sampler = Sampler(config.logprobs_mode)
        self.stats = RunnerStats()
        self.clock = StepClock(device)
        self.launched: deque[Launched] = deque()
        self.num_launched = 0
        self.last_end = None
        # Padded steps run through CUDA graphs on a GPU; padded decode steps run eagerly, same
        # shapes, elsewhere.
        decode = [] if config.enforce_eager else capture_sizes(config.max_num_seqs)
        # Ranks would have to agree on the sizes they leave out; they keep them all.
        if decode and device.type == "cuda" and tp is None:
            decode = decode_sizes(model, decode)
        # A mixed graph's padding sequence reads its keys through a block-table row, which holds
        # max_model_len tokens.
        mixed = (mixed_capture_sizes(min(config.max_num_batched_tokens, max_model_len))
                 if decode and pads_mixed_steps(device) else [])
        self.shapes = GraphShapes(decode, mixed, config.max_num_seqs)
        # The profiling step packs max_num_batched_tokens into sequences of max_model_len.
        self.max_seqs = max(config.max_num_seqs, -(-config.max_num_batched_tokens // max_model_len))
        max_tokens = max([config.max_num_batched_tokens, *decode])
        self.batch = InputBatch(self.max_seqs, max_model_len, self.block_size, model_config.vocab_size, device)
        # With tensor parallelism every rank must sample the same rows: a step waits for a grammar.
        self.structured = StructuredOutputs(config.model, model_config.vocab_size,
                                            list(model_config.eos_token_ids), self.max_seqs, defer=tp is None)
        self.inputs = SamplingInputs(self.batch, self.structured, model_config.vocab_size)
        max_blocks = self.batch.max_blocks
        # A padded mixed step has a sequence more than it may schedule.
        self.buffers = StepBuffers.allocate(max_tokens, self.max_seqs + 1, max_blocks, device)
        self.slots = [HostSlot.allocate(max_tokens, self.max_seqs + 1, max_blocks, config.max_logprobs, device)
                      for _ in range(MAX_STEPS_IN_FLIGHT)]
        self.slot = self.slots[0]
        # The device copy of the batch's block table, updated from each plan's new block ids.
        self.block_table = torch.zeros(self.max_seqs, max_blocks, dtype=torch.int32, device=device)
        # Each row's most recently sampled token, which the next step reads before the host has it.
        self.last_sampled = torch.zeros(self.max_seqs, dtype=torch.int64, device=device)
        mc = model.config
        self.graph_metas = {shape: graph_metadata(self.buffers, shape, max_model_len, mc.num_attention_heads,
                                                  mc.num_key_value_heads, mc.head_dim, dtype, kv_dtype)
                            for shape in self.shapes.all()}
        self.graphs = CudaGraphs(model, self.buffers, self.graph_metas)
        # Set by use_lora under --enable-lora, before the profiling step and the graphs.
        self.lora: LoraSlots | None = None

    def use_lora(self, slots: LoraSlots) -> None:
        """Serves LoRA adapters from `slots` (before the profiling step and the graph capture)."""
        self.lora = slots
        self.graphs.lora = slots.switch

    def reset(self) -> None:
        """Forgets every request (the scheduler that sent them is gone)."""
        self._settle()
        self.launched.clear()
        self.last_end = None
        for seq_id in list(self.batch.rows):
            self._remove(seq_id)

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        """Applies the plan's delta and queues the step's work on the device: each scheduled
        request's tokens, then the next token of every request whose known tokens (counting those
        that launched steps sample) are now all computed. Returns without waiting for the device,
        so the next plan can be launched while this step runs; at most MAX_STEPS_IN_FLIGHT at once."""
        if len(self.launched) == MAX_STEPS_IN_FLIGHT:
            raise ValueError(f"{MAX_STEPS_IN_FLIGHT} steps are in flight already: collect the oldest "
                             "result before launching another step")
        host_start = time.perf_counter_ns()
        rows, query_lens, seq_ids = self._apply(plan)
        batch = self.batch
        self.slot = self.slots[self.num_launched % MAX_STEPS_IN_FLIGHT]
        self.num_launched += 1
        if not len(rows):
            empty = np.zeros(0, dtype=np.int64)
            launched = Launched(plan.step_id, empty, empty, torch.from_numpy(empty), None, None)
        else:
            start = self.clock.mark()
            step = self._prepare(rows, query_lens)
            hidden = self._forward(step, self.kv_caches)
            prompt = None
            if batch.prompt_logprob_rows:
                prompt = self.inputs.prompt_logprobs(rows, query_lens, seq_ids, hidden, self.model.compute_logits)
            if batch.stop_ids or batch.bad_words or batch.penalised or self.structured:
                # Stop masks, bad words, penalties and grammars read each request's outputs on the
                # host: wait for the step in flight, whose forward ran before the one just queued.
                self._settle()
            sample_rows = rows[step.sample_rows]
            # Built while the device runs the forward.
            sampling = self.inputs.sampling(sample_rows, self.slot.staging)
            tokens, logprobs = self._sample(step, hidden, sampling, sample_rows)
            launched = Launched(plan.step_id, sample_rows, seq_ids[step.sample_rows], tokens,
                                logprobs, sampling.logprobs, start, self.clock.mark(), self.last_end,
                                prompt=prompt)
            self.last_end = launched.end
            batch.num_computed[rows] += query_lens
            if deferred := self.structured.take_deferred():
                launched.deferred = self._defer(deferred)
        launched.errors = self.structured.take_errors()
        self.launched.append(launched)
        self.stats.host_ns += time.perf_counter_ns() - host_start
        return launched

    def wait(self, step: Launched) -> None:
        """Blocks until the device has finished `step`. Touches no host state, so it may run on
        another thread than launch and collect (which must share one)."""
        if step.end is not None:
            self.clock.wait(step.end)

    def collect(self, step: Launched) -> StepResult:
        """The result of the oldest launched step, waiting for the device if it is not done."""
        if not self.launched or self.launched[0] is not step:
            raise ValueError("steps are collected in the order they were launched")
        self.launched.popleft()
        self._apply_sampled(step)
        host_start = time.perf_counter_ns()
        forward_ns = idle_ns = 0
        if step.end is not None:
            clock = self.clock
            forward_ns = clock.elapsed_ns(step.start, step.end)
            idle_ns = 0 if step.after is None else max(0, clock.elapsed_ns(step.after, step.start))
            self.stats.steps += 1
            self.stats.device_ns += forward_ns
            self.stats.idle_ns += idle_ns
        logprobs = None
        if step.logprobs is not None:
            asked = step.asked
            logprobs = step_logprobs(asked.index, asked.num_top, step.logprobs.values.numpy(),
                                     step.logprobs.ids.numpy())
        result = StepResult(step.step_id, step.seq_ids.tolist(), step.tokens.tolist(), forward_ns,
                            idle_ns, logprobs, None if step.prompt is None else step.prompt.result(),
                            step.errors, [] if step.deferred is None else step.deferred.tolist())
        self.stats.host_ns += time.perf_counter_ns() - host_start
        return result

    def _apply_sampled(self, step: Launched) -> None:
        """Waits for the step, then appends its sampled tokens to the batch (once)."""
        if step.applied:
            return
        wait = time.perf_counter_ns()
        self.wait(step)
        self.stats.wait_ns += time.perf_counter_ns() - wait
        rows, seq_ids, tokens = step.rows, step.seq_ids, step.tokens.numpy()
        if step.deferred is not None:
            kept = ~np.isin(seq_ids, step.deferred)
            rows, seq_ids, tokens = rows[kept], seq_ids[kept], tokens[kept]
        self.batch.append_sampled(rows, seq_ids, tokens)
        if self.structured:
            self.structured.accept(seq_ids, tokens)
        step.applied = True

    def _defer(self, seq_ids: list[int]) -> np.ndarray:
        """Rolls back the rows that sampled before their grammar was ready: their token is void, and
        the next step computes their last position again (structured_outputs.py)."""
        self.batch.num_computed[[self.batch.rows[s] for s in seq_ids]] -= 1
        return np.array(seq_ids, dtype=np.int64)

    def _settle(self) -> None:
        """Brings the batch's tokens up to date with every launched step."""
        for step in self.launched:
            self._apply_sampled(step)

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, num_sample_rows: int, num_splits: int | None = None,
                  decode_rows: int = 0) -> None:
        """One forward of `num_tokens` prompt tokens (in sequences of up to max_model_len sharing
        one scratch KV cache, their KV in `num_splits` segments if given) and `decode_rows`
        one-token sequences, the largest prompt logprobs pass (a chunk of positions, --max-logprobs
        top tokens), then logits and sampling for `num_sample_rows` rows, the first greedy and the
        others top-p: the largest step the engine will run, for memory profiling and warm-up."""
        seq_len = min(num_tokens, self.max_model_len)
        num_blocks = -(-seq_len // self.block_size)
        scratch = allocate_kv_cache(self.model.config, num_blocks, self.block_size, self.kv_dtype,
                                    self.device)
        full, rest = divmod(num_tokens, seq_len)
        lens = np.array([seq_len] * full + ([rest] if rest else []) + [1] * decode_rows, dtype=np.int64)
        # Negative ids: the scheduler's seq_ids start at 1.
        rows = np.array([self._add(NewRequest(-1 - i, [0] * n, 0, n, list(range(num_blocks)),
                                              SamplingParams()))
                         for i, n in enumerate(lens.tolist())], dtype=np.int64)
        try:
            # Unpadded: its metadata is its own, not a graph's.
            step = self._prepare(rows, lens, GraphShapes([], [], 0))
            step.meta.num_splits = num_splits
            hidden = self._forward(step, scratch)
            positions = torch.arange(min(num_tokens, PROMPT_LOGPROBS_CHUNK), device=self.device)
            chunked_logprobs(self.model.compute_logits, hidden, positions, torch.zeros_like(positions),
                             self.config.max_logprobs)
            n = num_sample_rows
            step.sample_rows = np.arange(n)
            step.logits_indices = torch.arange(n, device=self.device) % num_tokens
            # One greedy row, so that both argmax kernels compile here rather than at the first
            # greedy request.
            temperature = np.ones(n, np.float32)
            temperature[0] = 0.0
            sampling = make_sampling_batch(temperature, np.full(n, 0.9, np.float32),
                                           np.zeros(n, np.int64), np.zeros(n, np.float32), {},
                                           self.slot.staging.upload)
            self._sample(step, hidden, sampling, np.arange(n))
        finally:
            for i in range(len(lens)):
                self.batch.remove(-1 - i)

    def _apply(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Applies the plan's delta to the batch; returns the batch rows, query lengths and seq_ids
        of the sequences with tokens scheduled, in plan order."""
        batch = self.batch
        for seq_id in plan.dropped:
            self._remove(seq_id)
        new_rows = [self._add(r) for r in plan.new_requests]
        for r in plan.new_requests:
            self.structured.add(r)
        continuing = plan.continuing
        index = batch.rows
        try:
            cont_rows = [index[r.seq_id] for r in continuing]
        except KeyError as missing:
            raise batch.unknown(missing.args[0]) from None
        for r, row in zip(continuing, cont_rows):
            if r.new_block_ids:
                batch.append_blocks(row, r.new_block_ids)
        rows = np.array(new_rows + cont_rows, dtype=np.int64)
        query_lens = np.array([r.num_scheduled_tokens for r in plan.new_requests]
                              + [r.num_scheduled_tokens for r in continuing], dtype=np.int64)
        seq_ids = np.array([r.seq_id for r in plan.new_requests]
                           + [r.seq_id for r in continuing], dtype=np.int64)
        scheduled = query_lens > 0
        if not scheduled.all():
            return rows[scheduled], query_lens[scheduled], seq_ids[scheduled]
        return rows, query_lens, seq_ids

    def _add(self, request: NewRequest) -> int:
        row = self.batch.add(request)
        if self.lora is not None:
            self.lora.assign(row, request.lora_name, self.batch.rows.values())
        elif request.lora_name:
            raise ValueError(f"step plan asks for the LoRA adapter {request.lora_name!r}, but this executor "
                             "runs without --enable-lora; the scheduler and executor are out of step")
        return row

    def _remove(self, seq_id: int) -> None:
        self.batch.remove(seq_id)
        self.structured.remove(seq_id)

    def _prepare(self, rows: np.ndarray, query_lens: np.ndarray,
                 shapes: GraphShapes | None = None) -> Step:
        """Builds the step's inputs on the host, padded to one of `shapes` (default: the graphs'),
        and copies them into the StepBuffers."""
        num_tokens, num_seqs = int(query_lens.sum()), len(rows)
        if num_tokens > self.buffers.input_ids.numel() or num_seqs > self.max_seqs:
            raise ValueError(f"step plan schedules {num_tokens} tokens of {num_seqs} sequences, "
                             f"more than max_num_batched_tokens "
                             f"({self.config.max_num_batched_tokens}) or max_num_seqs allow")
        return self._upload(host_inputs(self.batch, rows, query_lens, shapes or self.shapes,
                                        self.max_model_len))

    def _upload(self, host: HostInputs) -> Step:
        buf, staging = self.buffers, self.slot.staging
        upload = staging.upload
        rows, input_ids, late, graph = host.rows, host.input_ids, host.late, host.graph
        num_tokens, num_seqs = len(input_ids), len(rows)
        staging.reset()
        if self.lora is not None:
            self.lora.upload(rows[:len(host.query_lens)], host.query_lens, upload)
        updates = self.batch.take_block_updates()
        if updates is not None:
            updates = upload(updates)
            self.block_table[updates[0], updates[1]] = updates[2].to(torch.int32)
        upload(host.positions, buf.positions[:num_tokens])
        upload(host.slot_mapping, buf.slot_mapping[:num_tokens])
        upload(rows, buf.rows[:num_seqs])
        if late is None:
            upload(input_ids, buf.input_ids[:num_tokens])
        elif graph is not None and not graph.mixed and late.shape[1] == len(host.sample_rows):
            # The pipelined steady state: a decode step whose every token is one that a step in
            # flight samples. One gather fills them all (padding rows too: their ids go unused).
            torch.index_select(self.last_sampled, 0, buf.rows[:num_seqs],
                               out=buf.input_ids[:num_tokens])
        else:
            upload(input_ids, buf.input_ids[:num_tokens])
            late = upload(late)
            buf.input_ids.index_copy_(0, late[0], self.last_sampled.index_select(0, late[1]))
        upload(host.seq_lens.astype(np.int32), buf.seq_lens[:num_seqs])
        torch.index_select(self.block_table, 0, buf.rows[:num_seqs],
                           out=buf.block_tables[:num_seqs])
        logits = None if host.logits_indices is None else upload(host.logits_indices)
        if graph is None or graph.mixed:
            upload(host.query_start_loc.astype(np.int32), buf.query_start_loc[:num_seqs + 1])
        if graph is not None:
            return Step(num_tokens, self.graph_metas[graph], graph, host.sample_rows, logits)
        # Graph steps never read the decode-row count: their metadata was fixed at capture.
        meta = AttentionMetadata(buf.slot_mapping[:num_tokens], buf.query_start_loc[:num_seqs + 1],
                                 buf.seq_lens[:num_seqs], buf.block_tables[:num_seqs],
                                 int(host.query_lens.max()), int(host.seq_lens.max()),
                                 num_decode_seqs=int(np.count_nonzero(host.query_lens == 1)))
        return Step(num_tokens, meta, None, host.sample_rows, logits)

    def _forward(self, step: Step, kv_caches: list[KVCache]) -> torch.Tensor:
        if step.graph is not None and step.graph in self.graphs.graphs:
            return self.graphs.replay(step.graph)
        buf = self.buffers
        # As the graphs of its size run it (and as projection_rows timed o_proj and down_proj), so
        # that --enforce-eager runs the same GEMMs.
        with blas_library(step.num_tokens):
            return self.model(buf.input_ids[:step.num_tokens], buf.positions[:step.num_tokens],
                              kv_caches, step.meta)

    def _sample(self, step: Step, hidden: torch.Tensor, sampling: SamplingBatch,
                sample_rows: np.ndarray) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """Queues logits and sampling, keeps the sampled tokens on the device for the next step,
        and queues their copy (and the logprobs') to the host; returns the host tensors, which
        hold the values once the device has passed the step's end."""
        staging = self.slot.staging
        num_samples = len(step.sample_rows)
        if not num_samples:
            staging.uploaded()
            return torch.zeros(0, dtype=torch.int64), None
        if step.logits_indices is None:
            rows, device_rows = hidden[:num_samples], self.buffers.rows[:num_samples]
        else:
            rows, device_rows = hidden[step.logits_indices], staging.upload(sample_rows)
        out = self.sampler(self.model.compute_logits(rows), sampling)
        if self.tp is not None:
            # Every rank samples from the same logits, but a random draw could still differ: the
            # ranks take rank 0's tokens, which they feed back on the device.
            self.tp.broadcast(out.tokens)
        staging.uploaded()
        self.last_sampled.index_copy_(0, device_rows, out.tokens)
        tokens, logprobs = out.tokens, out.logprobs
        if self.device.type == "cuda":
            slot = self.slot
            tokens = _copy_to_host(tokens, slot.sampled)
            if logprobs is not None:
                logprobs = SampledLogprobs(_copy_to_host(logprobs.values, slot.logprob_values),
                                           _copy_to_host(logprobs.ids, slot.logprob_ids))
        return tokens, logprobs


def _copy_to_host(tensor: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
    """Starts copying `tensor` into the front of a flat pinned buffer (contiguous, so no hidden
    sync); the returned view holds it after the next device sync."""
    host = pinned[:tensor.numel()].view(tensor.shape)
    host.copy_(tensor, non_blocking=True)
    return host
