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
# Background tokens a step may carry beside interactive requests: they lengthen the step that every
# interactive decode waits for. On the H200 a decode step costs 5.21 ms at batch 16 and 6.21 ms at
# 64, about 21 us a sequence, so 64 background tokens add about 1.3 ms at light interactive load;
# the allowance shrinks to 0 as interactive requests fill max_num_seqs. Tuned on the GPU.
BACKGROUND_TOKENS = 64

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


def num_unserved(running: Sequence[Request], served: set[int]) -> int:
    """How many background requests end `running` after the last one in `served`, the seq_ids a
    step serves; one whose last token is in flight, never planned again, stops the count."""
    count = 0
    for request in reversed(running):
        if (not request.background or request.seq_id in served
                or request.num_computed_tokens + 1 >= request.max_num_tokens):
            break
        count += 1
    return count


def background_budget(left: int, num_interactive: int, max_num_seqs: int) -> int:
    """The tokens of a step that background requests may take once interactive ones took theirs and
    `left` remain: all of them with no interactive request running or waiting, else at most
    BACKGROUND_TOKENS, less in proportion as interactive requests fill max_num_seqs."""
    if not num_interactive:
        return left
    return min(left, int(BACKGROUND_TOKENS * max(0.0, 1.0 - num_interactive / max_num_seqs)))
