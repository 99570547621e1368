"""The executor core: holds the model, the paged KV cache and each running request's state, and
turns a step plan (a delta) into one forward pass and one sampled token per finished prefill or decode."""
import itertools
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.attention import AttentionMetadata, get_backend
from executor_svc.kv_cache import allocate_kv_cache, bytes_per_block, determine_num_blocks
from executor_svc.model_config import ModelConfig, load_model_config, resolve_max_model_len
from executor_svc.models.llama import LlamaForCausalLM
from executor_svc.sampler import Sampler
from executor_svc.weight_loader import load_weights
from pagedserve.config import EngineConfig
from pagedserve.log import get_logger
from pagedserve.plan import ExecutorInfo, NewRequest, SamplingOptions, StepPlan, StepResult

log = get_logger(__name__)


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sampling: SamplingOptions
    generator: torch.Generator | None


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_rows: list[int]


class ModelRunner:
    """Runs step plans against the model. Requests persist between plans, keyed by seq_id."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        torch.manual_seed(config.seed)
        self.model_config: ModelConfig = load_model_config(config.model)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.max_model_len = resolve_max_model_len(self.model_config, config.max_model_len)
        self.block_size = config.block_size
        with torch.device(self.device), default_dtype(self.dtype):
            self.model = LlamaForCausalLM(self.model_config, get_backend(self.device),
                                          self.max_model_len)
        load_weights(self.model, config.model, config.load_format, config.seed)
        self.sampler = Sampler()
        self.requests: dict[int, RequestState] = {}
        block_bytes = bytes_per_block(self.model_config, self.block_size, self.dtype)
        self.num_blocks = determine_num_blocks(config, block_bytes, self.max_model_len, self.device,
                                               self._profile_peak_bytes)
        self.kv_caches = allocate_kv_cache(self.model_config, self.num_blocks, self.block_size,
                                           self.dtype, self.device)
        log.info("model_runner_ready", architecture=self.model_config.architecture,
                 device=str(self.device), dtype=dtype_name(self.dtype),
                 max_model_len=self.max_model_len, num_blocks=self.num_blocks)

    def describe(self) -> ExecutorInfo:
        return ExecutorInfo(num_blocks=self.num_blocks, block_size=self.block_size,
                            dtype=dtype_name(self.dtype), device=self.device.type,
                            vocab_size=self.model_config.vocab_size,
                            max_model_len=self.max_model_len,
                            eos_token_ids=list(self.model_config.eos_token_ids))

    def reset(self) -> None:
        """Forgets every request (the scheduler that sent them is gone)."""
        self.requests.clear()

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult:
        """Applies the plan's delta, computes each scheduled request's tokens, and samples the next
        token of every request whose known tokens are now all computed, in plan order."""
        for seq_id in plan.dropped:
            self._state(seq_id)
            del self.requests[seq_id]
        for request in plan.new_requests:
            self._add(request)
        for request in plan.continuing:
            self._state(request.seq_id).block_ids += request.new_block_ids
        scheduled = [(r.seq_id, r.num_scheduled_tokens)
                     for r in itertools.chain(plan.new_requests, plan.continuing)
                     if r.num_scheduled_tokens > 0]
        if not scheduled:
            return StepResult(plan.step_id)
        seq_ids = [seq_id for seq_id, _ in scheduled]
        states = [self.requests[seq_id] for seq_id in seq_ids]
        start = time.perf_counter_ns()
        batch = self._prepare(states, [n for _, n in scheduled])
        tokens = self._forward_and_sample(batch, [states[i] for i in batch.sampling_rows])
        forward_ns = time.perf_counter_ns() - start
        for state, (_, num_scheduled) in zip(states, scheduled):
            state.num_computed_tokens += num_scheduled
        sampled_ids = [seq_ids[i] for i in batch.sampling_rows]
        for seq_id, token in zip(sampled_ids, tokens):
            self.requests[seq_id].token_ids.append(token)
        return StepResult(plan.step_id, sampled_ids, tokens, forward_ns)

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, num_sample_rows: int) -> None:
        """One forward of `num_tokens` prompt tokens (in sequences of up to max_model_len sharing
        one scratch KV cache) plus logits and top-p sampling for `num_sample_rows` rows: the
        largest step the engine will run, for memory profiling and warm-up."""
        seq_len = min(num_tokens, self.max_model_len)
        num_blocks = -(-seq_len // self.block_size)
        scratch = allocate_kv_cache(self.model_config, num_blocks, self.block_size, self.dtype,
                                    self.device)
        full, rest = divmod(num_tokens, seq_len)
        lens = [seq_len] * full + ([rest] if rest else [])
        states = [RequestState([0] * n, 0, list(range(num_blocks)), SamplingOptions(), None)
                  for n in lens]
        batch = self._prepare(states, lens)
        hidden = self.model(batch.input_ids, batch.positions, scratch, batch.meta)
        rows = torch.arange(num_sample_rows, device=self.device) % num_tokens
        options = [SamplingOptions(temperature=1.0, top_p=0.9)] * num_sample_rows
        self.sampler(self.model.compute_logits(hidden[rows]), options, [None] * num_sample_rows)

    def _state(self, seq_id: int) -> RequestState:
        state = self.requests.get(seq_id)
        if state is None:
            raise ValueError(f"step plan names seq_id {seq_id}, which this executor does not hold; "
                             "the scheduler and executor are out of step (restart the scheduler)")
        return state

    def _add(self, request: NewRequest) -> None:
        seed = request.sampling.seed
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        self.requests[request.seq_id] = RequestState(list(request.token_ids),
                                                     request.num_computed_tokens,
                                                     list(request.block_ids), request.sampling,
                                                     generator)

    def _prepare(self, states: list[RequestState], num_scheduled: list[int]) -> Batch:
        query_lens = np.array(num_scheduled, dtype=np.int64)
        computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        known = np.array([len(s.token_ids) for s in states], dtype=np.int64)
        seq_lens = computed + query_lens
        self._check_lengths(states, seq_lens, known)
        query_start_loc = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        input_ids = np.fromiter(itertools.chain.from_iterable(
            s.token_ids[c:c + n] for s, c, n in zip(states, computed.tolist(), num_scheduled)),
            dtype=np.int64, count=num_tokens)
        positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - computed, query_lens)
        block_tables = np.zeros((len(states), max(len(s.block_ids) for s in states)), dtype=np.int64)
        for row, state in zip(block_tables, states):
            row[:len(state.block_ids)] = state.block_ids
        rows = np.repeat(np.arange(len(states)), query_lens)
        slot_mapping = (block_tables[rows, positions // self.block_size] * self.block_size
                        + positions % self.block_size)
        sampling_rows = np.flatnonzero(seq_lens == known)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping, torch.int64),
            query_start_loc=self._to_device(query_start_loc, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_tables=self._to_device(block_tables, torch.int32),
            max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()))
        return Batch(self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64),
                     meta, self._to_device(query_start_loc[1:][sampling_rows] - 1, torch.int64),
                     sampling_rows.tolist())

    def _check_lengths(self, states: list[RequestState], seq_lens: np.ndarray,
                       known: np.ndarray) -> None:
        blocks = np.array([len(s.block_ids) for s in states])
        if (seq_lens > known).any():
            raise ValueError("step plan schedules tokens past a request's known tokens: "
                             f"context lengths {seq_lens.tolist()}, known {known.tolist()}")
        if (seq_lens > blocks * self.block_size).any():
            raise ValueError(f"step plan gives too few blocks: context lengths {seq_lens.tolist()}, "
                             f"blocks {blocks.tolist()} of {self.block_size} tokens")
        if seq_lens.max() > self.max_model_len:
            raise ValueError(f"step plan exceeds max_model_len {self.max_model_len}: "
                             f"context lengths {seq_lens.tolist()}")

    def _forward_and_sample(self, batch: Batch, states: list[RequestState]) -> list[int]:
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not states:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return []
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        tokens = self.sampler(logits, [s.sampling for s in states], [s.generator for s in states])
        return tokens.tolist()

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.from_numpy(array).to(dtype)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def _profile_peak_bytes(self) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        scratch_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        scratch_bytes = (-(-scratch_tokens // self.block_size)
                         * bytes_per_block(self.model_config, self.block_size, self.dtype))
        self.dummy_run(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # CUDA context, cuBLAS workspaces and other memory that torch's allocator doesn't see.
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        log.info("profile_run", weights_gib=round(before / 2**30, 2),
                 outside_torch_gib=round(outside_torch / 2**30, 2))
        return peak - scratch_bytes + outside_torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but torch sees no CUDA GPU; use --device cpu")
    return device


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto`: float32 on the CPU, the checkpoint's dtype (bfloat16 when unstated) on a GPU."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    return getattr(torch, model.dtype or "bfloat16")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
