"""Stored responses (`store: true` on /v1/responses), for previous_response_id and GET/DELETE, in the
gateway's memory: bounded in bytes and age, oldest dropped first. Each entry holds its own turn
only (its input and output as chat messages) and names the one before it, so a long conversation
costs what it holds once, not once per turn. Replicas do not share it, and a restart empties it."""
import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.gateway.responses_schemas import Response
from pagedserve.gateway.schemas import ChatMessage

DEFAULT_STORE_MB = 256
DEFAULT_STORE_TTL_S = 3600.0


@dataclass(slots=True)
class StoredResponse:
    response: Response
    # The request's input items as the input_items route lists them (each with an id).
    input_items: list[dict]
    # This turn, without instructions: its input then its output, as chat messages.
    turn: list[ChatMessage]
    size: int
    stored_at: float = 0.0


class ResponseStore:
    """Responses by id; past `max_bytes` in all or `ttl_s` of age, the oldest go first."""

    def __init__(self, max_bytes: int = DEFAULT_STORE_MB << 20, ttl_s: float = DEFAULT_STORE_TTL_S) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        # The background responses being made, by id (see responses_background).
        self.running: dict[str, asyncio.Task] = {}

    async def stop(self) -> None:
        """Cancels the background responses still running, and waits for them to record it."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def put(self, entry: StoredResponse) -> None:
        """Keeps `entry` unless it alone exceeds the limit; drops the oldest to make room."""
        self.delete(entry.response.id)
        if entry.size > self.max_bytes:
            return
        entry.stored_at = time.monotonic()
        self._entries[entry.response.id] = entry
        self._bytes += entry.size
        self._expire()

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry is not None

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if self._bytes <= self.max_bytes and oldest.stored_at >= cutoff:
                return
            self.delete(oldest.response.id)
