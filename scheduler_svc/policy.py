"""Who runs first: the order of the waiting queues, the order of the running list (whose last entry
is the preemption victim), and the share of a step left to background (batch) requests.

Interactive requests always come before background ones. Within a class, --scheduling-policy fcfs
orders by arrival and priority by (priority, arrival), lower first, as vLLM does."""
import bisect
from collections import deque
from collections.abc import Sequence
from operator import attrgetter

from pagedserve.scheduler_svc.request import Request

FCFS, PRIORITY = "fcfs", "priority"
# What background requests may add to a step beside interactive ones, which every interactive
# decode waits for; both shrink to 0 as interactive requests fill max_num_seqs. Decode rows keep a
# step pure decode: on the H200 (Llama-3.1-8B shape) a decode graph costs 5.21 ms at batch 16 and
# 6.21 ms at 64, about 21 us a row, so 32 rows add about 0.7 ms. A step that computes any prompt
# costs more: eagerly about 25 ms at 50-70 rows, and even as a mixed-step graph (cuda_graphs.py)
# 32 background rows and 32 prompt tokens in every step took interactive TPOT at concurrency 10
# from 5.7 to 7.95 ms (`bench batch`, 2026-12-02). So background prompts are computed only in
# steps that prefill an interactive prompt anyway, at most BACKGROUND_PREFILL_TOKENS there, which
# bounds what that prompt's first token waits for them.
BACKGROUND_ROWS = 32
BACKGROUND_PREFILL_TOKENS = 256
# Without interactive prompts arriving (one long stream, say), a background prompt makes a step of
# its own after this many steps: one step of at most about 25 ms in 64 of about 6 ms, +7% at most.
BACKGROUND_PREFILL_INTERVAL = 64
# The three trade interactive latency for batch throughput. `bench batch` on the H200 with
# mixed-step graphs (concurrency 10 beside a 2,000-line batch, 2026-12-02; TTFT p50 / TPOT against
# the interactive load alone, and the batch's share of the capacity it left): these values 1.32x /
# 1.11x / 32%; 64 rows and 64 prompt tokens every other step 1.07x / 1.35x / 57%, every step 1.26x /
# 1.56x / 74%; 32 rows and 32 tokens every step 1.27x / 1.40x / 47%. TTFT p50 alone varied from 33
# to 39 ms between those runs. With mixed steps in one launch of small tiles (kernels/attention.py)
# these values gave 1.19x / 1.09x / 33% and 64 rows and 64 tokens every step 1.34x / 1.49x / 80%.
# BENCHMARKS.md has the tables.

_is_background = attrgetter("background")


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


def prefill_turn(prefills: bool, steps_without: int) -> tuple[bool, int]:
    """Whether background prompts may be computed in a step, which `prefills` an interactive prompt
    or not, after `steps_without` steps that did not let them; and the count after this step."""
    if prefills or steps_without >= BACKGROUND_PREFILL_INTERVAL:
        return True, 0
    return False, steps_without + 1


def background_budget(left: int, num_interactive: int, max_num_seqs: int, prefills: bool) -> tuple[int, int]:
    """The tokens of a step that background requests may take once interactive ones took theirs and
    `left` remain, and the most of them one background prompt may take: all of them with no
    interactive request running or waiting; else BACKGROUND_ROWS decode rows, plus, when the step
    `prefills` an interactive prompt, BACKGROUND_PREFILL_TOKENS of background prompts, both less in
    proportion as interactive requests fill max_num_seqs."""
    if not num_interactive:
        return left, left
    share = max(0.0, 1.0 - num_interactive / max_num_seqs)
    prefill = int(BACKGROUND_PREFILL_TOKENS * share) if prefills else 0
    return min(left, int(BACKGROUND_ROWS * share) + prefill), min(left, prefill)
