"""The executor core: holds the model, the paged KV cache and each running request's state, and
turns a step plan (a delta) into one forward pass and one sampled token per finished prefill or decode."""
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from pagedserve.executor_svc.attention_backend import AttentionMetadata, get_backend
from pagedserve.executor_svc.batch_limits import batch_defaults, resolve_batch_limits
from pagedserve.executor_svc.cuda_graphs import CudaGraphs, bucket, capture_sizes, decode_metadata
from pagedserve.executor_svc.device import default_dtype, dtype_name, resolve_device, resolve_dtype
from pagedserve.executor_svc.fp8 import Quantize, check_fp8_device
from pagedserve.executor_svc.host_slots import HostSlot
from pagedserve.executor_svc.input_batch import InputBatch
from pagedserve.executor_svc.kv_cache import (allocate_kv_cache, bytes_per_block, determine_num_blocks,
                                              resolve_kv_cache_dtype)
from pagedserve.executor_svc.logits import (GrammarMask, LogprobRows, Penalties, SampledLogprobs, gather_logprobs,
                                            step_logprobs)
from pagedserve.executor_svc.memory_profile import profile_peak_bytes
from pagedserve.executor_svc.model_config import ModelConfig, load_model_config, resolve_max_model_len
from pagedserve.executor_svc.models.llama import KVCache, LlamaForCausalLM
from pagedserve.executor_svc.parallel import init_group, rank_device, shard_config
from pagedserve.executor_svc.sampler import Sampler, SamplingBatch, make_sampling_batch
from pagedserve.executor_svc.step_buffers import StepBuffers, upload_pinned
from pagedserve.executor_svc.step_clock import StepClock
from pagedserve.executor_svc.structured_outputs import StructuredOutputs
from pagedserve.executor_svc.tp_workers import start_workers
from pagedserve.executor_svc.weight_loader import load_weights
from pagedserve.common.config import EngineConfig
from pagedserve.common.log import get_logger
from pagedserve.common.plan import (MAX_STEPS_IN_FLIGHT, ExecutorInfo, NewRequest, PromptLogprobs,
                             RequestError, StepPlan, StepResult)
from pagedserve.common.sampling_params import SamplingParams

log = get_logger(__name__)

# The warm-up step that compiles split-KV prefill attention: any prompt length does.
SPLIT_WARM_UP_TOKENS = 64


@dataclass(slots=True)
class Step:
    """One step's device inputs (in the StepBuffers) and which of its sequences sample."""
    num_tokens: int
    meta: AttentionMetadata
    graph_size: int | None
    sample_rows: np.ndarray
    # The hidden-state rows to sample; None when they are the first len(sample_rows) rows.
    logits_indices: torch.Tensor | None


@dataclass(slots=True)
class HostInputs:
    """One step's inputs as the host builds them, padded to its graph size if it has one."""
    rows: np.ndarray                     # [num_seqs] persistent-batch rows
    input_ids: np.ndarray                # [num_tokens]
    # [2, n] (token index, row): tokens that steps in flight sample, filled in on the device.
    late: np.ndarray | None
    positions: np.ndarray                # [num_tokens]
    slot_mapping: np.ndarray             # [num_tokens]
    seq_lens: np.ndarray                 # [num_seqs]
    query_lens: np.ndarray               # [num_seqs], unpadded
    query_start_loc: np.ndarray          # [num_seqs + 1], unpadded
    logits_indices: np.ndarray | None    # see Step
    sample_rows: np.ndarray
    graph_size: int | None


@dataclass(slots=True)
class PendingPrompt:
    """The prompt logprobs a launched step computes (see PromptLogprobs), on the host once the
    device passes the step's end."""
    seq_ids: list[int]
    starts: list[int]
    counts: list[int]
    num_top: np.ndarray
    logprobs: SampledLogprobs

    def result(self) -> PromptLogprobs:
        lp = self.logprobs
        entries = step_logprobs(np.arange(len(self.num_top)), self.num_top, lp.values.numpy(), lp.ids.numpy())
        return PromptLogprobs(self.seq_ids, self.starts, self.counts, entries)


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
    """Runs step plans against the model. Requests persist between plans, keyed by seq_id.
    `offline`: the batch limits a config leaves unset take vLLM's defaults for its LLM class
    rather than for its API server.

    With --tensor-parallel-size N, rank 0's runner starts ranks 1..N-1, whose runners repeat its
    launch, collect and reset calls (executor_svc/tp_workers.py); `rank` is this one's."""

    def __init__(self, config: EngineConfig, offline: bool = False, rank: int = 0) -> None:
        self.device = resolve_device(config.device)
        torch.manual_seed(config.seed)
        self.model_config: ModelConfig = load_model_config(config.model)
        # The shapes this rank holds: its share of the heads, KV heads, MLP width and vocabulary.
        self.rank_config = shard_config(self.model_config, config.tensor_parallel_size)
        self.quantization = config.quantization or self.model_config.quantization
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device, self.quantization)
        if self.quantization:
            check_fp8_device(self.device, self.dtype)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = resolve_max_model_len(self.model_config, config.max_model_len)
        self.config = resolve_batch_limits(config, batch_defaults(self.device, offline),
                                           self.max_model_len)
        self.block_size = self.config.block_size
        self.tp = self.workers = None
        if config.tensor_parallel_size > 1:
            self._join_group(config, offline, rank)
        try:
            self._build(self.config)
        except BaseException:
            # The other ranks fail the same way, or wait for rank 0 in a collective: stop them.
            if self.workers is not None:
                self.workers.stop()
            raise

    def _build(self, config: EngineConfig) -> None:
        backend = get_backend(self.device)
        with torch.device(self.device), default_dtype(self.dtype):
            self.model = LlamaForCausalLM(self.rank_config, backend, self.max_model_len, self.tp)
        self._load_weights(backend.per_token_quant_fp8 if self.quantization else None)
        self.sampler = Sampler()
        self.stats = RunnerStats()
        self.clock = StepClock(self.device)
        self.launched: deque[Launched] = deque()
        self.num_launched = 0
        self.last_end = None
        # Padded decode steps run through CUDA graphs on a GPU and eagerly, same shapes, elsewhere.
        self.graph_sizes = [] if config.enforce_eager else capture_sizes(config.max_num_seqs)
        # The profiling step packs max_num_batched_tokens into sequences of max_model_len.
        self.max_seqs = max(config.max_num_seqs,
                            -(-config.max_num_batched_tokens // self.max_model_len))
        max_tokens = max([config.max_num_batched_tokens, *self.graph_sizes])
        self.batch = InputBatch(self.max_seqs, self.max_model_len, self.block_size,
                                self.model_config.vocab_size, self.device)
        self.structured = StructuredOutputs(config.model, self.model_config.vocab_size,
                                            list(self.model_config.eos_token_ids), self.max_seqs,
                                            defer=config.tensor_parallel_size == 1)
        max_blocks = self.batch.max_blocks
        self.buffers = StepBuffers.allocate(max_tokens, self.max_seqs, max_blocks, self.device)
        self.slots = [HostSlot.allocate(max_tokens, self.max_seqs, max_blocks, self.device)
                      for _ in range(MAX_STEPS_IN_FLIGHT)]
        self.slot = self.slots[0]
        # The device copy of the batch's block table, updated from each plan's new block ids.
        self.block_table = torch.zeros(self.max_seqs, max_blocks, dtype=torch.int32,
                                       device=self.device)
        # Each row's most recently sampled token, which the next step reads before the host has it.
        self.last_sampled = torch.zeros(self.max_seqs, dtype=torch.int64, device=self.device)
        mc = self.rank_config
        self.graph_metas = {size: decode_metadata(self.buffers, size, self.max_model_len,
                                                  mc.num_attention_heads, mc.num_key_value_heads,
                                                  mc.head_dim, self.dtype, self.kv_dtype)
                            for size in self.graph_sizes}
        self.graphs = CudaGraphs(self.model, self.buffers, self.graph_metas)
        block_bytes = bytes_per_block(self.rank_config, self.block_size, self.kv_dtype)
        self.num_blocks = determine_num_blocks(config, block_bytes, self.max_model_len, self.device,
                                               partial(profile_peak_bytes, self), self.kv_dtype)
        if self.tp is not None:
            self.num_blocks = self.tp.min(self.num_blocks)
        self.kv_caches = allocate_kv_cache(self.rank_config, self.num_blocks, self.block_size,
                                           self.kv_dtype, self.device)
        if self.device.type == "cuda":
            # A prefill of few sequences splits its KV (kernels/attention.py's heuristic), which
            # neither the profiling step nor a decode graph compiles, and which a mixed step of a
            # short prompt among a few decodes meets in the middle of serving: compiled here.
            self.dummy_run(SPLIT_WARM_UP_TOKENS, 1, num_splits=2)
        if self.graph_sizes and self.device.type == "cuda":
            self.graphs.capture(self.kv_caches)
        else:
            log.info("cuda_graphs_off", reason="--enforce-eager" if config.enforce_eager else "not on a GPU")
        log.info("model_runner_ready", architecture=self.model_config.architecture,
                 device=str(self.device), dtype=dtype_name(self.dtype),
                 max_model_len=self.max_model_len, num_blocks=self.num_blocks,
                 max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                 cuda_graphs=bool(self.graphs.graphs), tensor_parallel_size=config.tensor_parallel_size)

    def _join_group(self, config: EngineConfig, offline: bool, rank: int) -> None:
        self.device = rank_device(self.device, rank)
        if rank:
            self.tp = init_group(rank, config.tensor_parallel_size, self.device)
            return
        self.workers = start_workers(config, offline, self.device)
        self.tp = self.workers.tp
        weakref.finalize(self, self.workers.stop)

    def _load_weights(self, quantize: Quantize | None) -> None:
        config = self.config
        start = time.perf_counter()
        load_weights(self.model, config.model, config.load_format, config.seed, quantize)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        log.info("model_loaded", weights_gib=round(weight_bytes / 2**30, 3),
                 parameters=sum(p.numel() for p in self.model.parameters()),
                 rank=0 if self.tp is None else self.tp.rank,
                 seconds=round(time.perf_counter() - start, 2), load_format=config.load_format,
                 quantization=self.quantization)

    def describe(self) -> ExecutorInfo:
        return ExecutorInfo(num_blocks=self.num_blocks, block_size=self.block_size,
                            dtype=dtype_name(self.dtype), device=self.device.type,
                            vocab_size=self.model_config.vocab_size,
                            max_model_len=self.max_model_len,
                            eos_token_ids=list(self.model_config.eos_token_ids),
                            max_num_seqs=self.config.max_num_seqs,
                            max_num_batched_tokens=self.config.max_num_batched_tokens,
                            gpu_memory_utilization=self.config.gpu_memory_utilization)

    def reset(self) -> None:
        """Forgets every request (the scheduler that sent them is gone)."""
        if self.workers is not None:
            self.workers.call("reset")
        self._settle()
        self.launched.clear()
        self.last_end = None
        for seq_id in list(self.batch.rows):
            self._remove(seq_id)

    def run(self, plan: StepPlan) -> StepResult:
        """Launches the plan's step and returns its result: one step at a time."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        """Applies the plan's delta and queues the step's work on the device: each scheduled
        request's tokens, then the next token of every request whose known tokens (counting those
        that launched steps sample) are now all computed. Returns without waiting for the device,
        so the next plan can be launched while this step runs; at most MAX_STEPS_IN_FLIGHT at once."""
        if len(self.launched) == MAX_STEPS_IN_FLIGHT:
            raise ValueError(f"{MAX_STEPS_IN_FLIGHT} steps are in flight already: collect the oldest "
                             "result before launching another step")
        if self.workers is not None:
            self.workers.call("launch", plan)
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
            prompt = self._prompt_logprobs(rows, query_lens, seq_ids, hidden) if batch.prompt_logprob_rows else None
            if batch.stop_ids or batch.penalised or self.structured:
                # Stop masks, penalties and grammars read each request's outputs on the host: wait
                # for the step in flight, whose forward ran before the one just queued.
                self._settle()
            sample_rows = rows[step.sample_rows]
            # Built while the device runs the forward.
            sampling = self._sampling(sample_rows)
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
        if self.workers is not None:
            self.workers.defer("collect")
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
    def dummy_run(self, num_tokens: int, num_sample_rows: int, num_splits: int | None = None) -> None:
        """One forward of `num_tokens` prompt tokens (in sequences of up to max_model_len sharing
        one scratch KV cache, their KV in `num_splits` segments if given) plus logits and
        sampling for `num_sample_rows` rows, the first greedy and the others top-p: the largest
        step the engine will run, for memory profiling and warm-up."""
        seq_len = min(num_tokens, self.max_model_len)
        num_blocks = -(-seq_len // self.block_size)
        scratch = allocate_kv_cache(self.rank_config, num_blocks, self.block_size, self.kv_dtype,
                                    self.device)
        full, rest = divmod(num_tokens, seq_len)
        lens = np.array([seq_len] * full + ([rest] if rest else []), dtype=np.int64)
        # Negative ids: the scheduler's seq_ids start at 1.
        rows = np.array([self.batch.add(NewRequest(-1 - i, [0] * n, 0, n, list(range(num_blocks)),
                                                   SamplingParams()))
                         for i, n in enumerate(lens.tolist())], dtype=np.int64)
        try:
            step = self._prepare(rows, lens)
            step.meta.num_splits = num_splits
            hidden = self._forward(step, scratch)
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
        new_rows = [batch.add(r) for r in plan.new_requests]
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

    def _remove(self, seq_id: int) -> None:
        self.batch.remove(seq_id)
        self.structured.remove(seq_id)

    def _prepare(self, rows: np.ndarray, query_lens: np.ndarray) -> Step:
        """Builds the step's inputs on the host and copies them into the StepBuffers."""
        batch, block_size = self.batch, self.block_size
        computed = batch.num_computed[rows]
        seq_lens = computed + query_lens
        known = batch.known_tokens(rows)
        self._check_lengths(rows, seq_lens, known)
        num_seqs, num_tokens = len(rows), int(query_lens.sum())
        graph_size = bucket(self.graph_sizes, num_seqs) if num_tokens == num_seqs else None
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        if graph_size is None:
            token_rows = np.repeat(rows, query_lens)
            positions = (np.arange(num_tokens)
                         - np.repeat(query_start_loc[:-1] - computed, query_lens))
        else:
            token_rows, positions = rows, computed
        input_ids = batch.token_ids[token_rows, positions]
        # Tokens sampled by steps still in flight: the device fills them in from last_sampled.
        late = np.flatnonzero(positions >= batch.num_tokens[token_rows])
        late = np.stack((late, token_rows[late])) if len(late) else None
        slot_mapping = (batch.block_table[token_rows, positions // block_size] * block_size
                        + positions % block_size)
        sample_rows = np.flatnonzero(seq_lens == known)
        # One token per sequence, all sampling: the logits rows are the first hidden-state rows.
        logits_indices = (None if num_tokens == num_seqs == len(sample_rows)
                          else query_start_loc[1:][sample_rows] - 1)
        if graph_size is not None:
            pad = graph_size - num_seqs
            input_ids, positions, rows = (_pad(a, pad, 0) for a in (input_ids, positions, rows))
            slot_mapping, seq_lens = _pad(slot_mapping, pad, -1), _pad(seq_lens, pad, 1)
            num_seqs = num_tokens = graph_size
        if num_tokens > self.buffers.input_ids.numel() or num_seqs > self.max_seqs:
            raise ValueError(f"step plan schedules {num_tokens} tokens of {num_seqs} sequences, "
                             f"more than max_num_batched_tokens "
                             f"({self.config.max_num_batched_tokens}) or max_num_seqs allow")
        return self._upload(HostInputs(rows, input_ids, late, positions, slot_mapping, seq_lens,
                                       query_lens, query_start_loc, logits_indices, sample_rows,
                                       graph_size))

    def _upload(self, host: HostInputs) -> Step:
        buf, staging = self.buffers, self.slot.staging
        upload = staging.upload
        rows, input_ids, late, graph_size = host.rows, host.input_ids, host.late, host.graph_size
        num_tokens, num_seqs = len(input_ids), len(rows)
        staging.reset()
        updates = self.batch.take_block_updates()
        if updates is not None:
            updates = upload(updates)
            self.block_table[updates[0], updates[1]] = updates[2].to(torch.int32)
        upload(host.positions, buf.positions[:num_tokens])
        upload(host.slot_mapping, buf.slot_mapping[:num_tokens])
        upload(rows, buf.rows[:num_seqs])
        if late is None:
            upload(input_ids, buf.input_ids[:num_tokens])
        elif graph_size is not None and late.shape[1] == len(host.sample_rows):
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
        if graph_size is not None:
            return Step(num_tokens, self.graph_metas[graph_size], graph_size, host.sample_rows, logits)
        upload(host.query_start_loc.astype(np.int32), buf.query_start_loc[:num_seqs + 1])
        # Graph steps never read the decode-row count: their metadata was fixed at capture.
        meta = AttentionMetadata(buf.slot_mapping[:num_tokens], buf.query_start_loc[:num_seqs + 1],
                                 buf.seq_lens[:num_seqs], buf.block_tables[:num_seqs],
                                 int(host.query_lens.max()), int(host.seq_lens.max()),
                                 num_decode_seqs=int(np.count_nonzero(host.query_lens == 1)))
        return Step(num_tokens, meta, graph_size, host.sample_rows, logits)

    def _sampling(self, rows: np.ndarray) -> SamplingBatch:
        b = self.batch
        generators = {}
        if b.generators:
            generators = {i: b.generators[row] for i, row in enumerate(rows.tolist())
                          if row in b.generators}
        sampling = make_sampling_batch(b.temperature[rows], b.top_p[rows], b.top_k[rows],
                                       b.min_p[rows], generators, self.slot.staging.upload)
        if b.stop_ids:
            mask = b.stop_mask(rows)
            # Unbounded (a request may name many stop ids), so not through the staging buffer.
            sampling.stop_mask = None if mask is None else upload_pinned(mask, self.device)
        if self.structured:
            sampling.grammar = self._grammar(rows)
        if b.logit_bias:
            sampling.logit_bias = b.logit_bias.select(rows, self.slot.staging.upload)
        if b.penalised:
            sampling.penalties = self._penalties(rows)
        if b.logprob_rows:
            num_top = b.num_logprobs[rows]
            index = np.flatnonzero(num_top >= 0)
            if len(index):
                sampling.logprobs = LogprobRows(index, self.slot.staging.upload(index), num_top[index])
        return sampling

    def _prompt_logprobs(self, rows: np.ndarray, query_lens: np.ndarray, seq_ids: np.ndarray,
                         hidden: torch.Tensor) -> PendingPrompt | None:
        """Queues the logprobs of the prompt tokens that this step's positions predict, for the
        requests that asked: the logits of every such position, not only the last."""
        found = self.batch.prompt_positions(rows, query_lens)
        if found is None:
            return None
        index, starts, counts, token_index, targets = found
        num_top = np.repeat(self.batch.num_prompt_logprobs[rows[index]], counts)
        logits = self.model.compute_logits(hidden[upload_pinned(token_index, self.device)])
        lp = gather_logprobs(logits.log_softmax(dim=-1), upload_pinned(targets, self.device), int(num_top.max()))
        if self.device.type == "cuda":
            lp = SampledLogprobs(_to_host(lp.values), _to_host(lp.ids))
        return PendingPrompt(seq_ids[index].tolist(), (starts + 1).tolist(), counts.tolist(), num_top, lp)

    def _grammar(self, rows: np.ndarray) -> GrammarMask | None:
        filled = self.structured.fill(self.batch.seq_ids[rows])
        if filled is None:
            return None
        index, bitmask = filled
        # Through pinned memory of its own: the next step refills the bitmask buffer.
        return GrammarMask(self.slot.staging.upload(index), upload_pinned(bitmask, self.device))

    def _penalties(self, rows: np.ndarray) -> Penalties | None:
        b, upload = self.batch, self.slot.staging.upload
        repetition, frequency, presence = b.repetition[rows], b.frequency[rows], b.presence[rows]
        index = np.flatnonzero((repetition != 1) | (frequency != 0) | (presence != 0))
        if not len(index):
            return None
        penalised = rows[index]
        repetition, frequency, presence = repetition[index], frequency[index], presence[index]
        columns = upload(np.stack((repetition, frequency, presence)))
        token_ids = upload_pinned(b.padded_tokens(penalised, self.model_config.vocab_size), self.device)
        return Penalties(upload(index), token_ids.long(), upload(b.num_prompt[penalised]),
                         columns[0] if (repetition != 1).any() else None,
                         columns[1] if frequency.any() else None,
                         columns[2] if presence.any() else None)

    def _check_lengths(self, rows: np.ndarray, seq_lens: np.ndarray, known: np.ndarray) -> None:
        blocks = self.batch.num_blocks[rows]
        if (seq_lens > known).any():
            raise ValueError("step plan schedules tokens past a request's known tokens: "
                             f"context lengths {seq_lens.tolist()}, known {known.tolist()}")
        if (seq_lens > blocks * self.block_size).any():
            raise ValueError(f"step plan gives too few blocks: context lengths {seq_lens.tolist()}, "
                             f"blocks {blocks.tolist()} of {self.block_size} tokens")
        if seq_lens.max() > self.max_model_len:
            raise ValueError(f"step plan exceeds max_model_len {self.max_model_len}: "
                             f"context lengths {seq_lens.tolist()}")

    def _forward(self, step: Step, kv_caches: list[KVCache]) -> torch.Tensor:
        if step.graph_size is not None and step.graph_size in self.graphs.graphs:
            return self.graphs.replay(step.graph_size)
        buf = self.buffers
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


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Starts copying `tensor` into pinned memory of its own (sizes vary with the prompts)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _pad(array: np.ndarray, n: int, value: int) -> np.ndarray:
    return np.concatenate((array, np.full(n, value, dtype=array.dtype)))
