"""Graceful shutdown: refuse new requests, let running ones finish, then end the rest with an error."""
import asyncio
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Protocol

from aiohttp import web

from pagedserve.gateway.errors import APIError, unavailable
from pagedserve.common.log import get_logger

log = get_logger(__name__)

# Served while draining, so that Prometheus still sees the last of the requests.
_OPEN_WHILE_DRAINING = frozenset({"/metrics"})
# How long interrupted requests get to write their error and close.
_INTERRUPT_GRACE_S = 2.0


class Interruptible(Protocol):
    """A request's engine work (a Generation, a Pooling) that a shutdown can end with an error."""

    def interrupt(self, error: Exception) -> None: ...


def shutting_down() -> APIError:
    return unavailable("The server is shutting down and did not finish this request; retry it "
                       "(on another replica if there is one).")


class Drain:
    """The gateway's requests in flight, and its shutdown: drain() refuses new requests (503, /health
    included), waits up to a timeout for the running ones, then interrupts every generation left so
    that streams end with an error event and `data: [DONE]`, and the others with a 503."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = False
        self.active = 0
        self.generations: set[Interruptible] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if self.draining and request.path not in _OPEN_WHILE_DRAINING:
            raise shutting_down()
        self.active += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self.active -= 1
            if not self.active:
                self._idle.set()

    @contextmanager
    def track(self, generation: Interruptible) -> Iterator[None]:
        """Registers a generation (or a pooling) for the duration of its request, so that drain() can interrupt it."""
        if self.expired:
            raise shutting_down()
        self.generations.add(generation)
        try:
            yield
        finally:
            self.generations.discard(generation)

    async def drain(self, timeout: float) -> None:
        """Returns once no request is in flight: those still running after `timeout` are interrupted."""
        self.draining = True
        log.info("gateway_draining", in_flight=self.active, shutdown_timeout_s=timeout)
        if await self._wait_idle(timeout):
            return
        self.expired = True
        log.warning("shutdown_timeout_expired", interrupted=len(self.generations), in_flight=self.active)
        for generation in self.generations:
            generation.interrupt(shutting_down())
        await self._wait_idle(_INTERRUPT_GRACE_S)

    async def _wait_idle(self, timeout: float) -> bool:
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self._idle.is_set()
