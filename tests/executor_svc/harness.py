"""Drives the executor core by hand, as the scheduler would: shuffled non-contiguous blocks,
chunked prompts, prefix-cache sharing, drops. Shared by the executor tests (CPU and GPU)."""
import random
from dataclasses import dataclass, field

import torch

from pagedserve.executor_svc.attention_backend import AttentionMetadata, TorchAttentionBackend
from pagedserve.executor_svc.device import default_dtype
from pagedserve.executor_svc.kv_cache import allocate_kv_cache
from pagedserve.executor_svc.layers.decoder import CausalLM, fold_norms
from pagedserve.executor_svc.model_config import load_model_config, resolve_max_model_len
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.weight_loader import load_weights
from pagedserve.executor_svc.worker import Worker
from pagedserve.common.config import EngineConfig
from pagedserve.common.plan import ContinuingRequest, NewRequest, StepPlan
from pagedserve.common.sampling_params import SamplingParams

BLOCK_SIZE = 8
NUM_BLOCKS = 96
NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class Seq:
    tokens: list[int]
    max_new: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    sent: bool = False
    sampling: SamplingParams = field(default_factory=lambda: GREEDY)


class MiniScheduler:
    """Just enough of a scheduler to build plans: first come first served under a token budget."""

    def __init__(self, worker: Worker, budget: int, seed: int = 0) -> None:
        self.worker, self.budget = worker, budget
        self.block_size = worker.describe().block_size
        self.free = list(range(worker.describe().num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[int, Seq] = {}
        self.finished: dict[int, list[int]] = {}
        self.to_drop: list[int] = []
        self.step_id = 0

    def add(self, seq_id: int, seq: Seq) -> None:
        self.seqs[seq_id] = seq

    def step(self) -> None:
        plan = StepPlan(self.step_id, dropped=self.to_drop)
        self.step_id, self.to_drop, left, scheduled = self.step_id + 1, [], self.budget, {}
        for seq_id, seq in self.seqs.items():
            n = min(len(seq.tokens) - seq.computed, left)
            if n == 0:
                continue
            needed = -(-(seq.computed + n) // self.block_size) - len(seq.blocks)
            new_blocks = [self.free.pop() for _ in range(max(needed, 0))]
            seq.blocks += new_blocks
            if seq.sent:
                plan.continuing.append(ContinuingRequest(seq_id, n, new_blocks))
            else:
                plan.new_requests.append(NewRequest(seq_id, list(seq.tokens), seq.computed, n,
                                                    list(seq.blocks), seq.sampling))
                seq.sent = True
            scheduled[seq_id], left = n, left - n
        result = self.worker.run(plan)
        assert result.step_id == plan.step_id
        for seq_id, n in scheduled.items():
            self.seqs[seq_id].computed += n
        plan_order = [r.seq_id for r in plan.new_requests] + [r.seq_id for r in plan.continuing]
        sampled = [s for s in plan_order if self.seqs[s].computed == len(self.seqs[s].tokens)]
        assert result.seq_ids == sampled
        for seq_id, token in zip(result.seq_ids, result.token_ids):
            seq = self.seqs[seq_id]
            seq.tokens.append(token)
            seq.output.append(token)
            if len(seq.output) == seq.max_new:
                self.drop(seq_id)
                self.finished[seq_id] = seq.output

    def drop(self, seq_id: int) -> Seq:
        self.to_drop.append(seq_id)
        return self.seqs.pop(seq_id)

    def run_to_completion(self) -> dict[int, list[int]]:
        while self.seqs:
            self.step()
        return self.finished


def make_worker(path, block_size: int = 8, **overrides) -> Worker:
    config = EngineConfig(**{"model": str(path), "block_size": block_size,
                             "num_gpu_blocks_override": NUM_BLOCKS, "device": "cpu",
                             "max_model_len": 256, **overrides})
    return Worker(config)


def logits_rows(model: CausalLM) -> list[int]:
    """From now on, the row count of each compute_logits call of `model`, which still computes."""
    rows = []
    compute_logits = model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(len(hidden))
        return compute_logits(hidden)

    model.compute_logits = recorded
    return rows


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def paged_prefill_logits(path, prompts: list[list[int]], backend=None,
                         device: torch.device = torch.device("cpu"),
                         dtype: torch.dtype = torch.float32, fp8: bool = False,
                         load_format: str = "auto", kv_dtype: torch.dtype | None = None,
                         fold: bool = False) -> list[torch.Tensor]:
    """Every prompt's logits at every position, all prompts packed into one flattened batch whose
    KV blocks are shuffled across the cache (of kv_dtype, by default the model's). `fp8`: the
    decoder's projections in FP8, quantized at load (an FP8 checkpoint loads as FP8 either way).
    `fold`: the norms folded into the projections after them, as the worker folds them."""
    config = load_model_config(path)
    backend = backend or TorchAttentionBackend()
    with torch.device(device), default_dtype(dtype):
        model = build_model(config, backend, resolve_max_model_len(config, None))
    fp8 = fp8 or config.quantization is not None
    load_weights(model, path, load_format, quantize=backend.per_token_quant_fp8 if fp8 else None)
    if fold:
        assert fold_norms(model)
    num_blocks = [-(-len(p) // BLOCK_SIZE) for p in prompts]
    block_ids = list(range(sum(num_blocks) + 3))
    random.Random(0).shuffle(block_ids)
    tables = torch.zeros(len(prompts), max(num_blocks), dtype=torch.int32)
    slots, positions = [], []
    for i, (prompt, n) in enumerate(zip(prompts, num_blocks)):
        table = torch.tensor([block_ids.pop() for _ in range(n)])
        tables[i, :n] = table
        pos = torch.arange(len(prompt))
        slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        positions.append(pos)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)])
    meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(device), seq_lens=lens.to(device),
                             query_start_loc=starts.to(device), block_tables=tables.to(device),
                             max_query_len=int(lens.max()), max_seq_len=int(lens.max()))
    kv_caches = allocate_kv_cache(config, sum(num_blocks) + 3, BLOCK_SIZE, kv_dtype or dtype, device)
    with torch.inference_mode():
        hidden = model(torch.tensor(sum(prompts, []), device=device),
                       torch.cat(positions).to(device), kv_caches, meta)
        logits = model.compute_logits(hidden).float()
    return list(logits.split(lens.tolist()))
