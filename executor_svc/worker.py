"""The executor's worker: what runs a model on one device, around the ModelRunner that runs its
steps. It resolves the device, dtype and quantization, builds the model (models.build_model) and
loads its weights, profiles memory to size the KV cache, allocates it, warms up, captures the
CUDA graphs, and carries tensor parallelism's control plane: it joins the group, and as rank 0
starts ranks 1..N-1 and has them repeat its launch, collect and reset calls (tp_workers.py)."""
import time
import weakref
from dataclasses import replace
from functools import partial

import torch

from pagedserve.executor_svc.attention_backend import get_backend
from pagedserve.executor_svc.batch_limits import batch_defaults, resolve_batch_limits
from pagedserve.executor_svc.device import (cap_cpu_threads, default_dtype, dtype_name, resolve_device,
                                            resolve_dtype, resolve_linear_dtype)
from pagedserve.executor_svc.fp8 import Quantize, check_fp8_device
from pagedserve.executor_svc.kv_cache import (allocate_kv_cache, bytes_per_block, determine_num_blocks,
                                              resolve_kv_cache_dtype)
from pagedserve.executor_svc.layers.decoder import CausalLM, fold_norms
from pagedserve.executor_svc.layers.encoder_attention import load_kernels
from pagedserve.executor_svc.layers.linear import NarrowHead, narrow_linears
from pagedserve.executor_svc.lora import LoraSlots, check_engine, load_adapters, parse_lora_modules
from pagedserve.executor_svc.memory_profile import profile_peak_bytes, used_bytes
from pagedserve.executor_svc.model_config import ModelConfig, load_model_config, resolve_max_model_len
from pagedserve.executor_svc.model_runner import Launched, ModelRunner
from pagedserve.executor_svc.models import ENCODERS, build_model
from pagedserve.executor_svc.parallel import init_group, rank_device, shard_config
from pagedserve.executor_svc.pooler_config import load_pooler_config
from pagedserve.executor_svc.pooling_model import build_pooler, pooling_info, resolve_runner
from pagedserve.executor_svc.pooling_runner import PoolingRunner
from pagedserve.executor_svc.projection_rows import choose as choose_projection_rows
from pagedserve.executor_svc.tp_workers import start_workers
from pagedserve.executor_svc.weight_loader import load_weights
from pagedserve.kernels.attention import MEDIUM_STEP_TOKENS
from pagedserve.common.config import EngineConfig
from pagedserve.common.log import get_logger
from pagedserve.common.plan import MAX_STEPS_IN_FLIGHT, ExecutorInfo, PoolingInfo, StepPlan, StepResult

log = get_logger(__name__)

# Warm-up steps of more tokens than a launch of small tiles takes (kernels/attention.py), so that
# they compile the prefill tiling's launches.
WARM_UP_TOKENS = MEDIUM_STEP_TOKENS + 64


class Worker:
    """Serves step plans on one device: what the executor server and the offline LLM hold.
    `offline`: the batch limits a config leaves unset take vLLM's defaults for its LLM class
    rather than for its API server. With --runner pooling (executor_svc/pooling_model.py picks it)
    its runner is a PoolingRunner, which computes whole prompts into pooled data and samples nothing.

    With --tensor-parallel-size N, rank 0's worker starts ranks 1..N-1 (`ranks`), whose workers
    repeat its launch, collect and reset calls (executor_svc/tp_worker.py); `rank` is this one's."""

    def __init__(self, config: EngineConfig, offline: bool = False, rank: int = 0) -> None:
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            cap_cpu_threads()
        torch.manual_seed(config.seed)
        self.model_config: ModelConfig = load_model_config(config.model, config.hf_overrides)
        self.runner_kind = resolve_runner(config, self.model_config)
        if self.runner_kind == "pooling" and config.tensor_parallel_size > 1:
            raise ValueError("--runner pooling runs on one GPU: drop --tensor-parallel-size (-tp)")
        # The shapes this rank holds: its share of the heads, KV heads, MLP width and vocabulary.
        self.rank_config = shard_config(self.model_config, config.tensor_parallel_size)
        self.quantization = config.quantization or self.model_config.quantization
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device, self.quantization)
        self.linear_dtype = resolve_linear_dtype(config.dtype, self.model_config, self.device, self.dtype,
                                                 self.quantization)
        check_engine(config, self.runner_kind, self.quantization)
        self.lora_modules = parse_lora_modules(config)
        if self.quantization:
            check_fp8_device(self.device, self.dtype)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = resolve_max_model_len(self.model_config, config.max_model_len)
        self.config = resolve_batch_limits(config, batch_defaults(self.device, offline),
                                           self.max_model_len, self.runner_kind == "pooling")
        if config.max_logprobs == -1:
            self.config = replace(self.config, max_logprobs=self.model_config.vocab_size)
        self.block_size = self.config.block_size
        self.tp = self.ranks = None
        if config.tensor_parallel_size > 1:
            self._join_group(config, offline, rank)
        try:
            self._build(self.config)
        except BaseException:
            # The other ranks fail the same way, or wait for rank 0 in a collective: stop them.
            if self.ranks is not None:
                self.ranks.stop()
            raise

    def _build(self, config: EngineConfig) -> None:
        # Before the model loads: the memory profile leaves out what was in use here already.
        self.used_at_start = used_bytes(self.device) if self.device.type == "cuda" else 0
        backend = get_backend(self.device)
        with torch.device(self.device), default_dtype(self.dtype):
            self.model = build_model(self.rank_config, backend, self.max_model_len, self.tp)
        # Checked before the weights load, which takes longer.
        adapters = load_adapters(self.lora_modules, self.model, config.max_lora_rank) if config.enable_lora else []
        self._load_weights(backend.per_token_quant_fp8 if self.quantization else None)
        # LoRA adds to each projection's own output, which a folded o_proj or down_proj has none of.
        if isinstance(self.model, CausalLM) and not config.enable_lora and fold_norms(self.model):
            log.info("norms_folded", layers=len(self.model.model.layers))
        if isinstance(self.model, CausalLM) and self.device.type == "cuda":
            choose_projection_rows(self.model, self.tp)
        self.pooling = PoolingInfo()
        if self.runner_kind == "pooling":
            self._build_pooling(config)
            return
        self.runner = ModelRunner(self.model, config, self.model_config, self.max_model_len, self.device,
                                  self.dtype, self.kv_dtype, self.tp)
        if config.enable_lora:
            self.runner.use_lora(LoraSlots(self.model, adapters, config.max_loras, config.max_lora_rank,
                                           self.runner.buffers.input_ids.numel(), self.runner.max_seqs, self.dtype,
                                           self.device))
        block_bytes = bytes_per_block(self.rank_config, self.block_size, self.kv_dtype)
        self.num_blocks = determine_num_blocks(config, block_bytes, self.max_model_len, self.device,
                                               partial(profile_peak_bytes, self), self.kv_dtype)
        if self.tp is not None:
            self.num_blocks = self.tp.min(self.num_blocks)
        self.runner.kv_caches = allocate_kv_cache(self.rank_config, self.num_blocks, self.block_size,
                                                  self.kv_dtype, self.device)
        self._warm_up(config)
        log.info("worker_ready", architecture=self.model_config.architecture,
                 device=str(self.device), dtype=dtype_name(self.dtype),
                 max_model_len=self.max_model_len, num_blocks=self.num_blocks,
                 max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                 cuda_graphs=bool(self.runner.graphs.graphs), tensor_parallel_size=config.tensor_parallel_size)

    def _build_pooling(self, config: EngineConfig) -> None:
        """The pooling runner; a decoder's KV cache holds the steps in flight, which the scheduler
        frees as each ends (an encoder's blocks are only the scheduler's count: it has no cache)."""
        pooler_config = load_pooler_config(config.model, config.pooler_config, config.hf_overrides)
        self.pooling = pooling_info(self.model_config, pooler_config)
        encoder = self.model_config.architecture in ENCODERS
        pooler = build_pooler(self.model, self.model_config, pooler_config, config.model)
        self.runner = PoolingRunner(self.model, pooler, self.block_size, self.device, encoder,
                                    self.model_config.hf_config.get("type_vocab_size", 1))
        self.num_blocks = config.num_gpu_blocks_override or (
            MAX_STEPS_IN_FLIGHT * (-(-config.max_num_batched_tokens // self.block_size) + config.max_num_seqs) + 1)
        if encoder:
            load_kernels(self.device, self.dtype)
        else:
            self.runner.kv_caches = allocate_kv_cache(self.rank_config, self.num_blocks, self.block_size,
                                                      self.kv_dtype, self.device)
        log.info("worker_ready", architecture=self.model_config.architecture, runner="pooling",
                 device=str(self.device), dtype=dtype_name(self.dtype), max_model_len=self.max_model_len,
                 num_blocks=self.num_blocks, max_num_seqs=config.max_num_seqs,
                 max_num_batched_tokens=config.max_num_batched_tokens, tasks=self.pooling.tasks)

    def _warm_up(self, config: EngineConfig) -> None:
        runner = self.runner
        if self.device.type == "cuda":
            # A prefill of few sequences splits its KV (kernels/attention.py's heuristic), and an
            # unsplit one beside decode rows attends them in a launch of their own: neither the
            # profiling step nor a graph compiles these, and without this the first requests
            # served paid for their compilation (TTFT p99 1.3 s at concurrency 10 on an H200).
            runner.dummy_run(WARM_UP_TOKENS, 1, num_splits=2)
            runner.dummy_run(WARM_UP_TOKENS, 1, num_splits=1, decode_rows=1)
        if runner.shapes.decode and self.device.type == "cuda":
            runner.graphs.capture(runner.kv_caches)
        else:
            log.info("cuda_graphs_off", reason="--enforce-eager" if config.enforce_eager else "not on a GPU")

    def _join_group(self, config: EngineConfig, offline: bool, rank: int) -> None:
        self.device = rank_device(self.device, rank)
        if rank:
            self.tp = init_group(rank, config.tensor_parallel_size, self.device)
            return
        self.ranks = start_workers(config, offline, self.device)
        self.tp = self.ranks.tp
        weakref.finalize(self, self.ranks.stop)

    def _load_weights(self, quantize: Quantize | None) -> None:
        config = self.config
        start = time.perf_counter()
        load_weights(self.model, config.model, config.load_format, config.seed, quantize)
        if self.linear_dtype != self.dtype:
            narrow_linears(self.model, self.linear_dtype)
            if isinstance(self.model, CausalLM):
                self.model.narrow_head = NarrowHead(self.model.head_weight())
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        log.info("model_loaded", model=config.model, weights_gib=round(weight_bytes / 2**30, 3),
                 parameters=sum(p.numel() for p in self.model.parameters()),
                 rank=0 if self.tp is None else self.tp.rank,
                 seconds=round(time.perf_counter() - start, 2), load_format=config.load_format,
                 quantization=self.quantization, linear_dtype=dtype_name(self.linear_dtype))

    def describe(self) -> ExecutorInfo:
        mixed_graph_tokens = 0 if self.runner_kind == "pooling" else self.runner.graphs.mixed_tokens()
        return ExecutorInfo(num_blocks=self.num_blocks, block_size=self.block_size,
                            dtype=dtype_name(self.dtype), device=self.device.type,
                            vocab_size=self.model_config.vocab_size,
                            max_model_len=self.max_model_len,
                            eos_token_ids=list(self.model_config.eos_token_ids),
                            max_num_seqs=self.config.max_num_seqs,
                            max_num_batched_tokens=self.config.max_num_batched_tokens,
                            gpu_memory_utilization=self.config.gpu_memory_utilization,
                            runner=self.runner_kind, pooling=self.pooling,
                            mixed_graph_tokens=mixed_graph_tokens, kv_cache_dtype=dtype_name(self.kv_dtype),
                            max_logprobs=self.config.max_logprobs, lora_names=list(self.lora_modules),
                            max_loras=self.config.max_loras if self.config.enable_lora else 0)

    def launch(self, plan: StepPlan) -> Launched:
        """Queues the plan's step on the device (see ModelRunner.launch); every rank does too."""
        if self.ranks is not None:
            self.ranks.call("launch", plan)
        return self.runner.launch(plan)

    def collect(self, step: Launched) -> StepResult:
        """The result of the oldest launched step, waiting for the device if it is not done."""
        result = self.runner.collect(step)
        if self.ranks is not None:
            # Once rank 0 has taken it: an out-of-order collect raises before and changes nothing.
            self.ranks.defer("collect")
        return result

    @property
    def synchronous(self) -> bool:
        """Whether launch runs its step to the end (on a CPU) rather than queueing it on a GPU."""
        return self.device.type != "cuda"

    def wait(self, step: Launched) -> None:
        """Blocks until the device has finished `step` (on any thread: see ModelRunner.wait)."""
        self.runner.wait(step)

    def run(self, plan: StepPlan) -> StepResult:
        """Launches the plan's step and returns its result: one step at a time."""
        return self.collect(self.launch(plan))

    def reset(self) -> None:
        """Forgets every request (the scheduler that sent them is gone)."""
        if self.ranks is not None:
            self.ranks.call("reset")
        self.runner.reset()
