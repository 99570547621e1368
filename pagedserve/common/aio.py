"""The one way every pagedserve process runs its event loop."""
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
