"""Who runs first: the order of the waiting queues, the order of the running list (whose last entry
is the preemption victim), how many prompt tokens a step computes beside decode rows, and the
share of a step left to background (batch) requests.

Interactive requests always come before background ones. Within a class, --scheduling-policy fcfs
orders by arrival and priority by (priority, arrival), lower first, as vLLM does."""
import bisect
from collections import deque
from collections.abc import Iterable, Sequence
from operator import attrgetter

from pagedserve.scheduler_svc.request import Request

FCFS, PRIORITY = "fcfs", "priority"
# What background requests may add to a step beside interactive ones, which every interactive
# decode waits for; both shrink to 0 as interactive requests fill max_num_seqs. Each background
# output token of a chat workload costs a decode row per step and about two prompt tokens, and
# both are cheap in a step that is a CUDA graph anyway: on the H200 (Llama-3.1-8B shape, a Worker
# driven by hand, 2026-12-03) 42 decode rows took 6.04 ms of device time a step against 5.22 for 10,
# and 32 more prompt tokens (contexts under 1,000) beside the 42 rows 0.23 ms more. So background
# rows and prompt chunks join every step that does not prefill an interactive prompt, and none that
# does: that prompt's first token waits for no background work.
BACKGROUND_ROWS, BACKGROUND_PREFILL_TOKENS = 20, 40
# Should interactive prompts arrive in every step, background work still joins one step in this many.
BACKGROUND_INTERVAL = 64
# The two trade interactive TPOT for batch throughput. `bench batch` on the H200 (interactive
# concurrency 10 beside a 2,000-line batch; TTFT p50 and TPOT against the load alone, and the
# batch's share of the capacity it left; 2026-12-03): 16 rows and 32 tokens 1.08x / 1.19x / 43%,
# 24 and 48 1.08x / 1.25x / 54%, 32 and 64 0.97x / 1.30x / 64%. The policy before, background
# prompts only in steps that prefilled an interactive prompt, gave 1.19x / 1.09x / 33%. Once the
# 32-96-token graphs ran their GEMMs through cuBLASLt (executor_svc/cuda_graphs.py; 2026-12-04),
# 16 and 32 gave 1.04x / 1.12x / 46.1%, and 20 and 40 1.05x / 1.18x / 49.5% (two device calls); with
# the split merge in one warp (kernels/attention.py), 20 and 40 1.04x / 1.19x / 50.8%, 24 and 48
# 1.06x / 1.23x / 56.3%, past the TPOT bar of 1.2x (one call).
# An 8-bit KV cache halves what a background row reads, which is most of its cost: with
# --kv-cache-dtype fp8, 20 and 40 gave 1.03x / 1.16x / 53.7% (2026-12-04), 30 and 60 1.04x / 1.16x /
# 70.2% (2026-12-05, one call each).
BACKGROUND_ROWS_FP8, BACKGROUND_PREFILL_TOKENS_FP8 = 30, 60

# A decode step reads every weight once and leaves the tensor cores mostly idle meanwhile: prompt
# tokens beside its decode rows cost little until the step's tokens make the projections compute-
# bound, while a step of whole prompts pays about 21 us a token at the H200's bf16 peak (Llama-3.1-8B
# shape; BENCHMARKS.md). So while requests decode and mixed steps replay as CUDA graphs, a step
# computes at most STEP_TOKENS tokens in all, prompt chunks filling what its decode rows leave;
# unless more prompt tokens wait than BACKLOG_STEPS such steps would take in (a burst of arrivals),
# whose first tokens would then wait longer than whole-prompt steps make them. `bench serve --dataset
# mixed` on the H200 (Llama-3.1-8B shape, 2026-12-04), against whole-prompt steps in the same device
# call: output tok/s +4.5 / +6.2 / +10.1 / +9.6 / +9.0% at concurrency 10-50, TPOT 5.4-7.6 ms
# against 5.7-8.6; STEP_TOKENS 192 and 320 gave 0.5-1.7% less than 256; with the backlog rule the
# TTFT mean at 50 fell from 156 to 144 ms, and BACKLOG_STEPS 4 cut it by 0.4-8 ms more for 0.3-2%
# of the throughput.
STEP_TOKENS = 256
BACKLOG_STEPS = 8
# A burst of prompts (each level of a sweep starts with one: every client sends at once) in steps of
# the whole budget (8,192 tokens, about 175 ms at 21 us a token) answers none of them before the
# first such step ends, and decodes those it has answered one token a step meanwhile; in steps of
# BURST_TOKENS the first prompts answer within about 45 ms. Same benchmark, one call, against the
# whole budget: TTFT mean 46.2 / 63.8 / 88.0 / 117.1 / 123.8 ms against 47.5 / 71.3 / 112.2 / 136.7 /
# 139.5 at concurrency 10-50, output tok/s within 0.3%; 4,096 gave 46.4-128.3 ms, and 1,024 lost at
# 40 and 50 (158 and 179 ms: too many steps for the burst's tokens).
BURST_TOKENS = 2048

_is_background = attrgetter("background")


def prompt_budget(num_running: int, waiting: Iterable[Request], max_num_batched_tokens: int,
                  mixed_graph_tokens: int) -> int:
    """How many prompt tokens a step may compute beside num_running running requests, `waiting` the
    queue whose prompts wait, with mixed steps of up to mixed_graph_tokens tokens replayed as CUDA
    graphs (0: none). All the step's budget where the rows alone come near STEP_TOKENS (the step is
    compute-bound anyway, and a trickle of prompt tokens would starve the batch); BURST_TOKENS where
    none runs (but the first waiting prompt whole) or where the waiting prompts hold more than
    BACKLOG_STEPS chunks; else a chunk that fills the step to STEP_TOKENS."""
    target = min(STEP_TOKENS, mixed_graph_tokens)
    if 2 * num_running >= target:
        return max_num_batched_tokens
    if not num_running:
        first = next(iter(waiting), None)
        first_len = 0 if first is None else len(first.token_ids)
        return min(max(BURST_TOKENS, first_len), max_num_batched_tokens)
    chunk = target - num_running
    # Counted only as far as the bound: an offline queue may hold thousands of prompts.
    backlog = 0
    for request in waiting:
        backlog += len(request.token_ids)
        if backlog > BACKLOG_STEPS * chunk:
            return min(BURST_TOKENS, max_num_batched_tokens)
    return chunk


def check_priority(priority: int, policy: str) -> None:
    """Refuses a nonzero priority under fcfs, as vLLM does, rather than ignoring what was asked."""
    if priority and policy == FCFS:
        raise ValueError(f"priority {priority} needs --scheduling-policy priority, but this server "
                         "schedules first come, first served; send priority 0 or restart it with "
                         "--scheduling-policy priority")


def order_key(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival


def enqueue(waiting: deque[Request], request: Request, policy: str) -> None:
    """Queues a new request in its class's waiting queue: last under fcfs, by order_key under priority."""
    if policy == FCFS or not waiting or order_key(waiting[-1]) <= order_key(request):
        waiting.append(request)
    else:
        bisect.insort(waiting, request, key=order_key)


def requeue(waiting: deque[Request], request: Request, policy: str) -> None:
    """Queues a preempted request: first under fcfs (it arrived before those still waiting, as a
    rule), by order_key under priority, so that a more urgent request that came since goes first."""
    if policy == FCFS:
        waiting.appendleft(request)
    else:
        bisect.insort(waiting, request, key=order_key)


def num_interactive(running: Sequence[Request]) -> int:
    """How many requests lead `running` before its background ones."""
    return bisect.bisect_left(running, True, key=_is_background)


def admit(running: list[Request], request: Request, policy: str) -> None:
    """Places a newly admitted request in `running`, which the scheduler serves front to back and
    preempts from the back: interactive requests in admission order (fcfs) or by order_key
    (priority), then background requests in admission order. The victim is thus the most recently
    admitted background request, else the last interactive one by the policy's order."""
    if request.background or policy == FCFS and not (running and running[-1].background):
        running.append(request)
    elif policy == FCFS:
        running.insert(num_interactive(running), request)
    else:
        bisect.insort(running, request, 0, num_interactive(running), key=order_key)


def background_turn(prefills: bool, steps_without: int) -> tuple[bool, int]:
    """Whether background requests may join a step, which `prefills` an interactive prompt or not,
    after `steps_without` steps that left them out; and the count after this step."""
    if not prefills or steps_without >= BACKGROUND_INTERVAL:
        return True, 0
    return False, steps_without + 1


def background_caps(kv_cache_dtype: str) -> tuple[int, int]:
    """The decode rows and prompt tokens background requests may add to a step beside interactive
    ones, for a KV cache of this element type (ExecutorInfo.kv_cache_dtype)."""
    if kv_cache_dtype.startswith("float8"):
        return BACKGROUND_ROWS_FP8, BACKGROUND_PREFILL_TOKENS_FP8
    return BACKGROUND_ROWS, BACKGROUND_PREFILL_TOKENS


def background_budget(left: int, num_interactive: int, max_num_seqs: int, turn: bool,
                      caps: tuple[int, int]) -> tuple[int, int, int]:
    """What background requests may take of a step once interactive ones took theirs and `left`
    tokens remain: tokens, the most of them prompts may take, and how many background requests
    may run (admission stops there). All of it with no interactive request running or waiting; none
    when it is not their `turn` (background_turn); else, for `caps` of (rows, prompt tokens) from
    background_caps, as many requests and tokens for their decode rows plus the prompt tokens,
    less in proportion as interactive requests fill max_num_seqs."""
    if not num_interactive:
        return left, left, max_num_seqs
    if not turn:
        return 0, 0, 0
    share = max(0.0, 1.0 - num_interactive / max_num_seqs)
    rows, prefill = int(caps[0] * share), int(caps[1] * share)
    return min(left, rows + prefill), min(left, prefill), rows
