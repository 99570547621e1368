"""The pooling runner (--runner pooling): each step computes its requests' whole prompts and
returns their pooled data, with no sampler, no CUDA graphs and no state kept between steps (the
scheduler never continues a pooling request). A decoder runs its paged prefill over a small KV
cache that only this step reads; an encoder runs with none. It shares the ModelRunner's step
clock and the model's attention metadata, and has its launch/collect interface, so the Worker and
the step loop drive either."""
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagedserve.common.plan import (INVALID_ARGUMENT, MAX_STEPS_IN_FLIGHT, NewRequest, RequestError, StepPlan,
                                    StepResult)
from pagedserve.executor_svc.attention_backend import AttentionMetadata
from pagedserve.executor_svc.kv_cache import KVCache
from pagedserve.executor_svc.pooler import Pooler
from pagedserve.executor_svc.step_clock import StepClock


@dataclass(slots=True)
class PoolingLaunched:
    """A step whose work is queued on the device: its requests' pooled data, packed, on the host
    once the device passes `end`."""
    step_id: int
    seq_ids: list[int]
    sizes: list[int]
    data: torch.Tensor
    start: object = None
    end: object = None
    after: object = None
    errors: list[RequestError] = field(default_factory=list)


@dataclass(slots=True)
class PackedPrompts:
    """A step's prompts packed one after another, on the host."""
    input_ids: np.ndarray
    positions: np.ndarray
    token_type_ids: np.ndarray
    seq_lens: list[int]


class PoolingRunner:
    """Turns step plans of pooling requests into their pooled data on `model`: a CausalLM (paged
    prefill into `kv_caches`, which the Worker allocates) or, with `encoder`, a bidirectional
    encoder with no KV cache, whose token type ids go below `type_vocab_size`."""

    def __init__(self, model: nn.Module, pooler: Pooler, block_size: int, device: torch.device,
                 encoder: bool, type_vocab_size: int = 1) -> None:
        self.model, self.pooler, self.block_size = model, pooler, block_size
        self.device, self.encoder, self.type_vocab_size = device, encoder, type_vocab_size
        self.kv_caches: list[KVCache] = []
        self.clock = StepClock(device)
        self.launched: deque[PoolingLaunched] = deque()
        self.last_end = None

    def reset(self) -> None:
        """Forgets the steps in flight (the scheduler that sent them is gone)."""
        self.launched.clear()
        self.last_end = None

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> PoolingLaunched:
        """Queues the forward and pooling of the plan's new requests, each prompt whole."""
        if len(self.launched) == MAX_STEPS_IN_FLIGHT:
            raise ValueError(f"{MAX_STEPS_IN_FLIGHT} steps are in flight already: collect the oldest "
                             "result before launching another step")
        _check_plan(plan)
        requests, errors = self._valid(plan.new_requests)
        if not requests:
            launched = PoolingLaunched(plan.step_id, [], [], torch.zeros(0))
        else:
            start = self.clock.mark()
            packed = pack(requests)
            hidden = self._forward(packed, requests)
            outputs = self.pooler(hidden, packed.seq_lens, [r.pooling for r in requests])
            data = torch.cat(outputs)
            if self.device.type == "cuda":
                data = data.to("cpu", non_blocking=True)
            launched = PoolingLaunched(plan.step_id, [r.seq_id for r in requests], [len(o) for o in outputs],
                                       data, start, self.clock.mark(), self.last_end)
            self.last_end = launched.end
        launched.errors = errors
        self.launched.append(launched)
        return launched

    def wait(self, step: PoolingLaunched) -> None:
        """Blocks until the device has finished `step`."""
        if step.end is not None:
            self.clock.wait(step.end)

    def collect(self, step: PoolingLaunched) -> StepResult:
        """The result of the oldest launched step, waiting for the device if it is not done."""
        if not self.launched or self.launched[0] is not step:
            raise ValueError("steps are collected in the order they were launched")
        self.launched.popleft()
        self.wait(step)
        forward_ns = idle_ns = 0
        if step.end is not None:
            forward_ns = self.clock.elapsed_ns(step.start, step.end)
            idle_ns = 0 if step.after is None else max(0, self.clock.elapsed_ns(step.after, step.start))
        return StepResult(step.step_id, forward_ns=forward_ns, idle_ns=idle_ns, errors=step.errors,
                          pooled_seq_ids=step.seq_ids, pooled_sizes=step.sizes, pooled_data=step.data.tolist())

    def _valid(self, requests: list[NewRequest]) -> tuple[list[NewRequest], list[RequestError]]:
        """The requests an encoder can embed, and an error for each with a token type id past its
        table (which would index out of bounds on the device)."""
        if not self.encoder:
            return requests, []
        bad = {r.seq_id for r in requests if any(not 0 <= t < self.type_vocab_size for t in r.token_type_ids)}
        errors = [RequestError(seq_id, INVALID_ARGUMENT, f"token_type_ids must be below this model's "
                                                         f"type_vocab_size {self.type_vocab_size}")
                  for seq_id in bad]
        return [r for r in requests if r.seq_id not in bad], errors

    def _forward(self, packed: PackedPrompts, requests: list[NewRequest]) -> torch.Tensor:
        def upload(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device, non_blocking=True)

        input_ids, positions = upload(packed.input_ids), upload(packed.positions)
        if self.encoder:
            return self.model(input_ids, positions, upload(packed.token_type_ids), packed.seq_lens)
        meta = prefill_metadata(requests, packed, self.block_size, upload)
        return self.model(input_ids, positions, self.kv_caches, meta)


def _check_plan(plan: StepPlan) -> None:
    if plan.continuing:
        raise ValueError("a pooling step plan continues requests, but pooling prompts are computed "
                         "whole in one step")
    for r in plan.new_requests:
        if r.pooling is None or r.num_computed_tokens or r.num_scheduled_tokens != len(r.token_ids):
            raise ValueError(f"request {r.seq_id} is not a pooling prompt scheduled whole: the pooling "
                             "runner computes every prompt in one step")


def pack(requests: list[NewRequest]) -> PackedPrompts:
    """The requests' prompts packed, with positions from 0 and token types (zeros where absent)."""
    lens = [len(r.token_ids) for r in requests]
    return PackedPrompts(
        np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in requests]),
        np.concatenate([np.arange(n, dtype=np.int64) for n in lens]),
        np.concatenate([np.asarray(r.token_type_ids or [0] * n, dtype=np.int64) for r, n in zip(requests, lens)]),
        lens)


def prefill_metadata(requests: list[NewRequest], packed: PackedPrompts, block_size: int,
                     upload) -> AttentionMetadata:
    """Attention metadata of whole prompts written into their plan's blocks."""
    lens = np.array(packed.seq_lens, dtype=np.int32)
    table = np.zeros((len(requests), max(len(r.block_ids) for r in requests)), dtype=np.int32)
    for row, r in zip(table, requests):
        row[:len(r.block_ids)] = r.block_ids
    rows = np.repeat(np.arange(len(requests)), lens)
    positions = packed.positions
    slots = table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    query_start_loc = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=query_start_loc[1:])
    return AttentionMetadata(upload(slots), upload(query_start_loc), upload(lens), upload(table),
                             int(lens.max()), int(lens.max()))
