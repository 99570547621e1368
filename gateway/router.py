"""Which scheduler serves a prompt: the least loaded one, unless the one its first blocks hash to is
not much busier, so that requests sharing a prefix meet in one prefix cache."""
from collections.abc import Sequence

# The prefix that picks a scheduler: the prompt's first whole KV blocks, at most this many.
AFFINITY_BLOCKS = 4
# The scheduler a prefix hashes to keeps it while its load is at most this factor and slack above
# the least loaded one's; beyond that the request spills to the least loaded.
OVERLOAD_FACTOR = 1.5
OVERLOAD_SLACK = 8


def prefix_key(prompt_token_ids: list[int], block_size: int) -> int | None:
    """A hash of the prompt's first whole blocks (up to AFFINITY_BLOCKS); None under one block."""
    blocks = min(AFFINITY_BLOCKS, len(prompt_token_ids) // block_size)
    if blocks == 0:
        return None
    return hash(tuple(prompt_token_ids[:blocks * block_size]))


def pick(loads: Sequence[int | None], key: int | None) -> int:
    """The index of the scheduler for a request. loads[i] is scheduler i's running + waiting
    requests, None while it is out of rotation; at least one must be in it. `key` is the request's
    prefix_key, None for no affinity."""
    serving = [i for i, load in enumerate(loads) if load is not None]
    least = min(serving, key=loads.__getitem__)
    if key is None:
        return least
    # Rendezvous hashing: a scheduler leaving the rotation moves only the prefixes that were its own.
    preferred = max(serving, key=lambda i: hash((key, i)))
    if loads[preferred] <= OVERLOAD_FACTOR * loads[least] + OVERLOAD_SLACK:
        return preferred
    return least
