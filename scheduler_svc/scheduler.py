"""Continuous batching: one token budget per step, chunked prefill, prefix caching, recompute preemption."""
import time
from collections import deque
from itertools import islice

from pagedserve.common.config import EngineConfig
from pagedserve.common.log import get_logger
from pagedserve.common.plan import ContinuingRequest, ExecutorInfo, RequestError, StepPlan, StepResult
from pagedserve.common.sampling_params import check_request
from pagedserve.scheduler_svc.block_manager import BlockManager, hash_blocks
from pagedserve.scheduler_svc.logprobs import attach_logprobs, gather_prompt_logprobs
from pagedserve.scheduler_svc.policy import (admit, background_budget, background_caps, background_turn,
                                             check_priority, enqueue, num_interactive, prompt_budget, requeue)
from pagedserve.scheduler_svc.pooling import check_pooling
from pagedserve.scheduler_svc.request import Request, RequestDelta, RequestStatus, drop_deferred
from pagedserve.scheduler_svc.request_checks import check_lora, check_prompt
from pagedserve.scheduler_svc.step_stats import StepStats

log = get_logger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue holds --max-num-queued-reqs requests; the caller should retry later."""


class Scheduler:
    """Decides what the executor computes each step and turns its sampled tokens into request outputs.

    Steps may be pipelined: `schedule` can plan step N+1 before step N's result reaches `update`.
    Planning advances each request's computed count as if its step had run; a request computed
    up to its known tokens then decodes the token that the step in flight samples, which the
    executor fills in from its own copy. A request that turns out to have stopped at step N was
    planned once more in N+1; that extra token is discarded. Results must reach `update` in plan
    order.

    Not thread-safe: call add, abort, schedule and update from one thread (or one event loop).
    """

    def __init__(self, config: EngineConfig, info: ExecutorInfo, offline: bool = False) -> None:
        if info.max_num_seqs < 1 or info.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({info.max_num_seqs}) and max_num_batched_tokens "
                             f"({info.max_num_batched_tokens}) must be at least 1")
        # The KV cache's geometry and the batch limits are the executor's (its Describe), never
        # flags of the scheduler's.
        self.block_size = info.block_size
        self.max_num_seqs = info.max_num_seqs
        self.max_num_queued_reqs = config.max_num_queued_reqs
        self.policy = config.scheduling_policy
        # A request's prompt tokens a step (--long-prefill-token-threshold); the budget bounds it anyway.
        self.prefill_cap = config.long_prefill_token_threshold or info.max_num_batched_tokens
        self.max_num_batched_tokens = info.max_num_batched_tokens
        # Mixed steps replayed as CUDA graphs (of up to this many tokens) size the prompt chunks that
        # join decode rows (policy.prompt_budget); 0 gives prompts every step's whole budget. Offline
        # (the LLM class) no client waits on a first token, so its prompts take the whole budget,
        # where the GEMMs run at their best rate: the chunks and burst steps buy latency with
        # throughput. Offline `mixed` on an H100 (Llama-3.1-8B shape, 2026-12-07, alternating in one
        # call): 528 steps against 561, FP8 + FP8 KV 14,246 / 14,349 tok/s against 13,999 / 14,158,
        # bf16 8,842 / 8,848 against 8,742 / 8,786.
        self.chunking_graph_tokens = 0 if offline else info.mixed_graph_tokens
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.max_logprobs = info.max_logprobs
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.lora_names, self.max_loras = frozenset(info.lora_names), info.max_loras
        # "pooling": every request is a pooling one (scheduler_svc/pooling.py), else none is.
        self.runner, self.pooling = info.runner, info.pooling
        self.block_manager = BlockManager(info.num_blocks, info.block_size, config.enable_prefix_caching)
        self.kv_capacity = self.block_manager.num_usable_blocks * self.block_size
        # A sequence of n tokens needs KV for its first n - 1 only, so a pool smaller than the
        # context caps lengths like max_model_len does; such requests finish with "length".
        self.max_len = min(self.max_model_len, self.kv_capacity + 1)
        if self.max_len < self.max_model_len:
            log.warning("kv_cache_smaller_than_context", kv_capacity_tokens=self.kv_capacity,
                        max_model_len=self.max_model_len)
        # Interactive and background requests wait apart; `running` holds the interactive ones first
        # (scheduler_svc/policy.py).
        self.waiting: deque[Request] = deque()
        self.waiting_background: deque[Request] = deque()
        self.running: list[Request] = []
        # Steps with background work that left it out (policy.background_turn).
        self.steps_without_background = 0
        self.background_caps = background_caps(info.kv_cache_dtype)
        self.num_arrivals = 0
        self.requests: dict[int, Request] = {}
        self.request_ids: dict[str, Request] = {}
        self.dropped: list[int] = []
        self.step_id = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Prompt tokens of requests that have produced their first token, and tokens generated.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.stats = StepStats()
        # Whether the engine had nothing to do since the last plan: the executor's idle time
        # before the next step is then the wait for requests, not the control path's cost.
        self._paused = True

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_background)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def kv_usage(self) -> float:
        return self.block_manager.usage

    def has_work(self) -> bool:
        return bool(self.waiting or self.waiting_background or self.running or self.dropped)

    def add(self, request: Request) -> None:
        """Queues a new request; raises ValueError if it can never be served (an empty or too long
        prompt, a token id outside the vocabulary, a list past its bound), QueueFull if the waiting
        queue is at --max-num-queued-reqs."""
        check_prompt(request, self.max_model_len, self.max_len, self.kv_capacity)
        check_pooling(request, self.runner, self.pooling, self.max_model_len,
                      min(self.max_num_batched_tokens, self.kv_capacity))
        check_request(request.prompt_token_ids, request.sampling, self.vocab_size, self.max_logprobs)
        check_priority(request.priority, self.policy)
        check_lora(request.lora_name, self.lora_names)
        if request.seq_id in self.requests or request.request_id in self.request_ids:
            raise ValueError(f"request {request.request_id!r} (seq {request.seq_id}) is already queued")
        if self.max_num_queued_reqs is not None and self._num_queued(request) >= self.max_num_queued_reqs:
            raise QueueFull(f"{self._num_queued(request)} requests already wait for a slot, the "
                            "--max-num-queued-reqs limit; retry shortly")
        request.set_stop_conditions(self.eos_token_ids, self.max_len)
        if self.block_manager.enable_prefix_caching and request.pooling is None:
            hash_blocks(request.block_hashes, request.token_ids, self.block_size, request.prefix_salt)
        request.status = RequestStatus.WAITING
        request.arrival = self.num_arrivals
        self.num_arrivals += 1
        self.requests[request.seq_id] = request
        self.request_ids[request.request_id] = request
        enqueue(self._waiting_of(request), request, self.policy)

    def _num_queued(self, request: Request) -> int:
        # Waiting requests that the next step can admit into free running slots are not queued;
        # background ones do not count against an interactive request, which they never delay.
        waiting = self.num_waiting if request.background else len(self.waiting)
        return waiting - max(0, self.max_num_seqs - len(self.running))

    def abort(self, key: str | int) -> bool:
        """Stops a request given its request_id or seq_id; False if it is unknown or already finished."""
        request = self.request_ids.get(key) if isinstance(key, str) else self.requests.get(key)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self._waiting_of(request).remove(request)
        self._finish(request, "abort")
        if not self.has_work():
            self._paused = True
        return True

    def schedule(self) -> StepPlan:
        """Plans the next step: interactive requests, running then waiting in the policy's order,
        then background ones in what the policy leaves them (scheduler_svc/policy.py)."""
        start = time.perf_counter_ns()
        self.step_id += 1
        plan = StepPlan(self.step_id, after_pause=self._paused)
        self._paused = False
        num_preemptions = self.num_preemptions
        running = self.running
        background = self.waiting_background or running and running[-1].background
        end = num_interactive(running) if background else len(running)
        prompts = prompt_budget(end, self.waiting, self.max_num_batched_tokens, self.chunking_graph_tokens)
        budget, prompts = self._schedule_running(plan, self.max_num_batched_tokens, prompts, 0, end)
        # After a preemption the pool is short: admitting would only cause more preemptions.
        if self.num_preemptions == num_preemptions:
            admitted = min(budget, prompts)
            budget -= admitted - self._schedule_waiting(plan, admitted, self.waiting)
        if background:
            self._schedule_background(plan, budget, num_preemptions)
        plan.dropped, self.dropped = self.dropped, []
        plan.schedule_ns = time.perf_counter_ns() - start
        return plan

    def _schedule_background(self, plan: StepPlan, budget: int, num_preemptions: int) -> None:
        """Background requests, once interactive ones are planned: running ones in admission order
        and, if no interactive request waits, waiting ones, within background_budget. Those a step
        leaves out keep their blocks until an interactive request needs them (_make_room): preempting
        them would recompute their prompts."""
        start = num_interactive(self.running)
        # More tokens than requests planned: one of them is prefilling.
        prefills = bool(plan.new_requests) or self.max_num_batched_tokens - budget > len(plan.continuing)
        turn, self.steps_without_background = background_turn(prefills, self.steps_without_background)
        budget, prompts, max_rows = background_budget(budget, start + len(self.waiting), self.max_num_seqs, turn,
                                                      self.background_caps)
        budget, prompts = self._schedule_running(plan, budget, prompts, start, len(self.running))
        if self.num_preemptions == num_preemptions and not self.waiting and prompts:
            self._schedule_waiting(plan, min(budget, prompts), self.waiting_background,
                                   min(self.max_num_seqs, start + max_rows))

    def _schedule_running(self, plan: StepPlan, budget: int, prompts: int, start: int,
                          end: int) -> tuple[int, int]:
        """Plans running[start:end] in order until the budget is spent, prompt chunks at most
        `prompts` tokens in all (0: prompts wait); preempts from the end of `running` when the pool
        runs out of blocks. Returns the budget and the prompt tokens left."""
        block_size = self.block_size
        block_manager = self.block_manager
        running = self.running
        append = plan.continuing.append
        caching = block_manager.enable_prefix_caching
        # Preemption pops from the end of `running`, which this loop has not reached: the list
        # iterator checks the length on every turn, so iterating it while preempting is safe.
        for request in islice(running, start, end):
            if not budget:
                break
            computed = request.num_computed_tokens
            n = len(request.token_ids) - computed
            chunk = n > 1
            if n <= 0:
                # Ahead of its results: the next token is the one a step in flight samples,
                # unless that one is the last.
                if computed + 1 >= request.max_num_tokens:
                    continue
                n = 1
            elif chunk:
                if not prompts:
                    continue
                n = min(n, prompts, self.prefill_cap)
            if n > budget:
                n = budget
            num_new = (computed + n + block_size - 1) // block_size - len(request.block_ids)
            if num_new:
                while num_new > block_manager.num_free_blocks:
                    victim = running.pop()
                    self._preempt(victim)
                    if victim is request:
                        return budget, prompts
                new_block_ids = block_manager.allocate(num_new)
                request.block_ids += new_block_ids
                append(ContinuingRequest(request.seq_id, n, new_block_ids))
            else:
                append(ContinuingRequest(request.seq_id, n, []))
            computed += n
            request.num_computed_tokens = computed
            # Checked inline: a decode step fills a block only once every block_size steps.
            if caching and computed // block_size > request.num_registered_blocks:
                block_manager.cache_blocks(request)
            budget -= n
            if chunk:
                prompts -= n
        return budget, prompts

    def _schedule_waiting(self, plan: StepPlan, budget: int, waiting: deque[Request],
                          max_running: int | None = None) -> int:
        """Admits requests from the head of `waiting` while they fit, up to max_running running
        (default max_num_seqs); returns the budget left."""
        block_size = self.block_size
        block_manager = self.block_manager
        running = self.running
        if max_running is None:
            max_running = self.max_num_seqs
        while waiting and budget:
            if len(running) >= max_running and not self._make_room(waiting):
                break
            request = waiting[0]
            # In arrival order: a request whose adapter finds no slot holds back those behind it
            # until a running adapter's requests end, as a prompt that finds no blocks does.
            if not self._lora_fits(request):
                break
            num_tokens = len(request.token_ids)
            if request.sampling.prompt_logprobs is None or request.prompt_logprobs_sent:
                cached, num_cached = block_manager.lookup(request.block_hashes, num_tokens)
            else:
                # Prompt logprobs need every prompt position computed, cached or not.
                cached, num_cached = [], 0
            n = min(num_tokens - num_cached, budget, self.prefill_cap if request.pooling is None else budget)
            if request.pooling is not None and n < num_tokens:
                break  # a pooling prompt runs whole (scheduler_svc/pooling.py): it waits for a step
            num_new = (num_cached + n + block_size - 1) // block_size - len(cached)
            # Head-of-line blocking: when the first waiting request does not fit, nothing behind
            # it is admitted either. Strict order keeps a long prompt from starving behind a stream
            # of short ones; the blocks it waits for come back as running requests finish, or
            # from background requests, preempted for an interactive one.
            if not block_manager.can_allocate(num_new, cached):
                if not self._make_room(waiting):
                    break
                continue
            waiting.popleft()
            request.block_ids = block_manager.allocate(num_new, cached)
            if not request.num_preemptions:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            admit(running, request, self.policy)
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_cached
            plan.new_requests.append(request.new_request(num_cached, n))
            request.num_computed_tokens = num_cached + n
            request.num_registered_blocks = len(cached)
            if block_manager.enable_prefix_caching:
                block_manager.cache_blocks(request)
            budget -= n
        return budget

    def _lora_fits(self, request: Request) -> bool:
        """Whether a step may serve the request's adapter: it runs already, or fewer than max_loras do."""
        if not request.lora_name:
            return True
        running = {r.lora_name for r in self.running if r.lora_name}
        return request.lora_name in running or len(running) < self.max_loras

    def _make_room(self, waiting: deque[Request]) -> bool:
        """Preempts the most recent background request for an interactive one that does not fit."""
        if waiting is self.waiting_background or not (self.running and self.running[-1].background):
            return False
        self._preempt(self.running.pop())
        return True

    def _waiting_of(self, request: Request) -> deque[Request]:
        return self.waiting_background if request.background else self.waiting

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        requeue(self._waiting_of(request), request, self.policy)
        self.dropped.append(request.seq_id)
        self.num_preemptions += 1
        log.debug("preempted", seq_id=request.seq_id, num_tokens=len(request.token_ids))

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:
        """Applies a step's result; returns one output per request that received a token or
        finished. Tokens of requests aborted, finished or preempted since the plan are dropped."""
        start = time.perf_counter_ns()
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} does not match plan {plan.step_id}")
        if result.prompt_logprobs is not None:
            gather_prompt_logprobs(self.requests, result.prompt_logprobs)
        failed = self._fail(result.errors) if result.errors else []
        pooled = self._finish_pooled(result.pooled()) if result.pooled_seq_ids else []
        seq_ids, token_ids = drop_deferred(self.requests, result) if result.deferred else (result.seq_ids, result.token_ids)
        outputs = self._append_tokens(seq_ids, token_ids)
        if result.logprobs is not None:
            attach_logprobs(outputs, result)
        outputs += failed + pooled
        self.stats.observe(plan.schedule_ns + time.perf_counter_ns() - start, result.forward_ns,
                           0 if plan.after_pause else result.idle_ns)
        if not self.has_work():
            self._paused = True
        return outputs

    def _fail(self, errors: list[RequestError]) -> list[RequestDelta]:
        """Ends each request the executor failed on its own, with its error."""
        outputs = []
        for e in errors:
            request = self.requests.get(e.seq_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            self.running.remove(request)
            self._finish(request, "error")
            outputs.append(RequestDelta(e.seq_id, request.request_id, [], True, "error", None,
                                        request.num_prompt_tokens, len(request.output_token_ids),
                                        request.num_cached_tokens, error_code=e.code, error=e.message))
        return outputs

    def _finish_pooled(self, pooled: dict[int, list[float]]) -> list[RequestDelta]:
        """Ends each pooling request whose prompt the step computed, with its pooled data; one
        preempted since (waiting again) is computed again."""
        outputs = []
        for seq_id, data in pooled.items():
            request = self.requests.get(seq_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            self._finish(request, "stop")
            self.num_prompt_tokens += request.num_prompt_tokens
            outputs.append(RequestDelta(seq_id, request.request_id, [], True, "stop", None,
                                        request.num_prompt_tokens, 0, 0, pooled=data))
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    def _append_tokens(self, seq_ids: list[int], token_ids: list[int]) -> list[RequestDelta]:
        block_size = self.block_size
        requests = self.requests
        caching = self.block_manager.enable_prefix_caching
        running = RequestStatus.RUNNING
        outputs = []
        append = outputs.append
        num_finished = 0
        for seq_id, token_id in zip(seq_ids, token_ids):
            request = requests.get(seq_id)
            if request is None or request.status is not running:
                continue
            token_ids = request.token_ids
            token_ids.append(token_id)
            num_tokens = len(token_ids)
            if caching and num_tokens % block_size == 0:
                hash_blocks(request.block_hashes, token_ids, block_size, request.prefix_salt)
                self.block_manager.cache_blocks(request)
            num_output_tokens = num_tokens - request.num_prompt_tokens
            if num_output_tokens == 1:
                self.num_prompt_tokens += request.num_prompt_tokens
            if token_id in request.stop_ids and num_output_tokens >= request.sampling.min_tokens:
                self._finish(request, "stop", token_id)
            elif num_tokens >= request.max_num_tokens:
                self._finish(request, "length")
            reason = request.finish_reason
            if reason:
                num_finished += 1
            out = RequestDelta(seq_id, request.request_id, [token_id], reason is not None, reason,
                               request.stop_token_id, request.num_prompt_tokens, num_output_tokens,
                               request.num_cached_tokens)
            if request.prompt_logprobs and not request.prompt_logprobs_sent:
                out.prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
            append(out)
        if num_finished:
            self.running = [r for r in self.running if r.status is running]
        self.num_generation_tokens += len(outputs)
        return outputs

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

