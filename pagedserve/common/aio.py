"""The one way every pagedserve process runs its event loop, and the queue helper its services share."""
import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Runs `coro` on uvloop when it is installed, else on asyncio's default loop."""
    # The import is tried apart from the run: an ImportError raised inside the coroutine must
    # reach the caller, not be taken for a missing uvloop and run the coroutine a second time.
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def take_all(queue: asyncio.Queue[T]) -> list[T]:
    """Waits for one item, then takes every item already queued behind it."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
