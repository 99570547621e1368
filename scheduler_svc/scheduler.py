"""Continuous batching: one token budget per step, chunked prefill, prefix caching, recompute preemption."""
from collections import deque
from itertools import chain

from pagedserve.config import EngineConfig
from pagedserve.log import get_logger
from pagedserve.plan import ContinuingRequest, NewRequest, StepPlan, StepResult
from scheduler_svc.block_manager import BlockManager, hash_blocks
from scheduler_svc.request import Request, RequestOutput, RequestStatus

log = get_logger(__name__)


class Scheduler:
    """Decides what the executor computes each step and turns its sampled tokens into request outputs.

    Not thread-safe: call add, abort, schedule and update from one thread (or one event loop).
    """

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int,
                 eos_token_ids: list[int]) -> None:
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({config.max_num_seqs}) and max_num_batched_tokens "
                             f"({config.max_num_batched_tokens}) must be at least 1")
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_capacity = self.block_manager.num_usable_blocks * self.block_size
        # A sequence of n tokens needs KV for its first n - 1 only, so a pool smaller than the
        # context caps lengths like max_model_len does; such requests finish with "length".
        self.max_len = min(max_model_len, self.kv_capacity + 1)
        if self.max_len < max_model_len:
            log.warning("kv_cache_smaller_than_context", kv_capacity_tokens=self.kv_capacity,
                        max_model_len=max_model_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.request_ids: dict[str, Request] = {}
        self.dropped: list[int] = []
        self.step_id = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def kv_usage(self) -> float:
        return self.block_manager.usage

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.dropped)

    def add(self, request: Request) -> None:
        """Queues a new request; raises ValueError if it can never be served."""
        n = len(request.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: send at least one token")
        if n >= self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"has {n} tokens; shorten it to at most {self.max_model_len - 1} tokens to leave room "
                f"for output")
        if n >= self.max_len:
            raise ValueError(
                f"the KV cache holds {self.kv_capacity} tokens, but the prompt has {n} tokens; "
                f"shorten it to at most {self.max_len - 1} tokens or give the server more KV cache memory")
        if request.seq_id in self.requests or request.request_id in self.request_ids:
            raise ValueError(f"request {request.request_id!r} (seq {request.seq_id}) is already queued")
        params = request.sampling
        request.stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            request.stop_ids |= self.eos_token_ids
        request.max_num_tokens = self.max_len
        if params.max_tokens is not None:
            request.max_num_tokens = min(n + params.max_tokens, self.max_len)
        if self.block_manager.enable_prefix_caching:
            hash_blocks(request.block_hashes, request.token_ids, self.block_size)
        request.status = RequestStatus.WAITING
        self.requests[request.seq_id] = request
        self.request_ids[request.request_id] = request
        self.waiting.append(request)

    def abort(self, key: str | int) -> bool:
        """Stops a request given its request_id or seq_id; False if it is unknown or already finished."""
        request = self.request_ids.get(key) if isinstance(key, str) else self.requests.get(key)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, "abort")
        return True

    def schedule(self) -> StepPlan:
        """Plans the next step: running requests first, then waiting ones in arrival order."""
        self.step_id += 1
        plan = StepPlan(self.step_id)
        num_preemptions = self.num_preemptions
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        # After a preemption the pool is short: admitting would only cause more preemptions.
        if self.num_preemptions == num_preemptions:
            self._schedule_waiting(plan, budget)
        plan.dropped, self.dropped = self.dropped, []
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        block_size = self.block_size
        block_manager = self.block_manager
        i = 0
        while i < len(self.running) and budget:
            request = self.running[i]
            computed = request.num_computed_tokens
            n = min(len(request.token_ids) - computed, budget)
            num_new = (computed + n + block_size - 1) // block_size - len(request.block_ids)
            new_block_ids = []
            if num_new:
                while not block_manager.can_allocate(num_new):
                    victim = self.running.pop()
                    self._preempt(victim)
                    if victim is request:
                        return budget
                new_block_ids = block_manager.allocate(num_new)
                request.block_ids += new_block_ids
            plan.continuing.append(ContinuingRequest(request.seq_id, n, new_block_ids))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        block_size = self.block_size
        block_manager = self.block_manager
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_tokens = len(request.token_ids)
            cached, num_cached = block_manager.lookup(request.block_hashes, num_tokens)
            n = min(num_tokens - num_cached, budget)
            num_new = (num_cached + n + block_size - 1) // block_size - len(cached)
            # Head-of-line blocking: when the oldest waiting request does not fit, nothing behind
            # it is admitted either. Strict FIFO keeps a long prompt from starving behind a stream
            # of short ones; the blocks it waits for come back as running requests finish.
            if not block_manager.can_allocate(num_new, cached):
                break
            self.waiting.popleft()
            request.block_ids = block_manager.allocate(num_new, cached)
            request.num_computed_tokens = num_cached
            if not request.num_preemptions:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_cached
            plan.new_requests.append(NewRequest(request.seq_id, list(request.token_ids), num_cached, n,
                                                list(request.block_ids), request.sampling_options()))
            budget -= n

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.dropped.append(request.seq_id)
        self.num_preemptions += 1
        log.debug("preempted", seq_id=request.seq_id, num_tokens=len(request.token_ids))

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Applies a step's result to the requests of `plan`; returns one output per request that
        received a token or finished. Requests aborted since `plan` was made are skipped."""
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} does not match plan {plan.step_id}")
        block_size = self.block_size
        block_manager = self.block_manager
        caching = block_manager.enable_prefix_caching
        requests = self.requests
        for scheduled in chain(plan.new_requests, plan.continuing):
            request = requests.get(scheduled.seq_id)
            if request is None:
                continue
            before = request.num_computed_tokens // block_size
            request.num_computed_tokens += scheduled.num_scheduled_tokens
            after = request.num_computed_tokens // block_size
            if caching and after > before:
                for i in range(before, after):
                    block_manager.cache(request.block_ids[i], request.block_hashes[i])
        outputs = []
        num_finished = 0
        for seq_id, token_id in zip(result.seq_ids, result.token_ids):
            request = requests.get(seq_id)
            if request is None:
                continue
            request.append_token(token_id)
            num_tokens = len(request.token_ids)
            if caching and num_tokens % block_size == 0:
                hash_blocks(request.block_hashes, request.token_ids, block_size)
            finish_reason = self._check_stop(request, token_id, num_tokens)
            if finish_reason:
                self._finish(request, finish_reason, token_id if finish_reason == "stop" else None)
                num_finished += 1
            outputs.append(RequestOutput(seq_id, request.request_id, [token_id], bool(finish_reason),
                                         finish_reason, request.stop_token_id,
                                         len(request.prompt_token_ids), len(request.output_token_ids),
                                         request.num_cached_tokens))
        if num_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    @staticmethod
    def _check_stop(request: Request, token_id: int, num_tokens: int) -> str | None:
        if token_id in request.stop_ids and len(request.output_token_ids) >= request.sampling.min_tokens:
            return "stop"
        if num_tokens >= request.max_num_tokens:
            return "length"
        return None

    def _finish(self, request: Request, reason: str, stop_token_id: int | None = None) -> None:
        if request.status is RequestStatus.RUNNING:
            self.dropped.append(request.seq_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_token_id = stop_token_id
        self.block_manager.free(request.block_ids)
        request.block_ids = []
        del self.requests[request.seq_id]
        del self.request_ids[request.request_id]
