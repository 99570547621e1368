"""The schedulers one gateway serves from (--scheduler-address A,B,...): their load, polled in the
background, which of them are in rotation, and the pick of one per prompt (see router)."""
import asyncio
import math
import time
from dataclasses import dataclass

from pagedserve.common.log import get_logger
from pagedserve.gateway import router
from pagedserve.gateway.engine_client import EngineClient, ModelSpec, SchedulerDown
from pagedserve.gateway.errors import APIError, unavailable
from pagedserve.v1 import engine_pb2 as pb

log = get_logger(__name__)

POLL_INTERVAL_S = 0.5
# /health answers from scheduler states at most this old, so that probes, which anyone may send
# (they need no key), never make the gateway call its schedulers more often than its poll. Twice the
# poll's interval: the poll keeps every scheduler in rotation fresher than that, so a probe waits on
# a call only for one out of rotation (or one slow to answer).
HEALTH_MAX_AGE_S = 2 * POLL_INTERVAL_S
# A scheduler out of rotation is probed again after this, doubling up to the maximum.
MIN_BACKOFF_S, MAX_BACKOFF_S = 0.5, 5.0


def split_addresses(value: str) -> list[str]:
    """The addresses of --scheduler-address A,B,...; raises ValueError on an empty or repeated one."""
    addresses = [a.strip() for a in value.split(",")]
    if not all(addresses):
        raise ValueError(f"--scheduler-address {value!r} has an empty entry; list addresses as A,B,...")
    if len(set(addresses)) < len(addresses):
        raise ValueError(f"--scheduler-address {value!r} lists an address twice; list each scheduler once")
    return addresses


@dataclass(slots=True)
class Engine:
    """One scheduler as this gateway sees it."""
    index: int
    address: str
    client: EngineClient
    # Its last ModelInfo, live counters included.
    info: pb.ModelInfo | None = None
    # Why it is out of rotation; None while it is in.
    down: str | None = "not polled yet"
    # Engine requests this gateway started on it since `info` was polled, less those that ended
    # since: what its counters do not show yet.
    pending: int = 0
    backoff: float = MIN_BACKOFF_S
    retry_at: float = 0.0
    # time.monotonic() of its last poll's end.
    polled_at: float = -math.inf

    def load(self) -> int | None:
        if self.down is not None:
            return None
        return max(0, self.info.num_running + self.info.num_waiting + self.pending)


class EnginePool:
    """Polls every scheduler every POLL_INTERVAL_S (one out of rotation with backoff) and picks one
    per prompt. All must serve the same model: one that does not stays out of rotation."""

    def __init__(self, scheduler_address: str) -> None:
        self.engines = [Engine(i, a, EngineClient(a)) for i, a in enumerate(split_addresses(scheduler_address))]
        # The model facts of the first scheduler that answered (the reference), which every other
        # one must match.
        self.spec: ModelSpec | None = None
        self.block_size = 0
        self._reference: Engine | None = None
        self._polling: asyncio.Task | None = None
        # The poll that /health started, which the probes arriving meanwhile wait for too.
        self._probe: asyncio.Future | None = None

    def start(self) -> None:
        self._polling = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._polling is not None:
            self._polling.cancel()
        await asyncio.gather(*(e.client.close() for e in self.engines))

    async def model_spec(self) -> ModelSpec:
        """The model facts; raises a 503 APIError until a scheduler has answered."""
        if self.spec is None:
            await self.poll()
        if self.spec is None:
            raise unavailable("No scheduler is reachable yet; retry shortly.")
        return self.spec

    def pick(self, prompt_token_ids: list[int], count: int) -> Engine:
        """The scheduler for `count` engine requests of one prompt. With none in rotation, any: its
        call then fails with the reason, or succeeds if it came back since the last poll."""
        loads = [e.load() for e in self.engines]
        if all(load is None for load in loads):
            loads = [e.pending for e in self.engines]
        key = router.prefix_key(prompt_token_ids, self.block_size) if self.block_size else None
        engine = self.engines[router.pick(loads, key)]
        engine.pending += count
        return engine

    def ended(self, engine: Engine) -> None:
        """One engine request picked for `engine` ended."""
        engine.pending -= 1

    def failed(self, engine: Engine, error: APIError) -> None:
        """Takes `engine` out of rotation if `error` says its scheduler is down."""
        if isinstance(error, SchedulerDown):
            self._take_out(engine, error.info.message)

    async def health(self) -> list[str | None]:
        """Each scheduler's state, None if it serves, else why not, as polled at most
        HEALTH_MAX_AGE_S ago. Those polled longer ago (out of rotation, waiting out a backoff) are
        polled now, so that a probe that sees one serve also puts it back in rotation; probes that
        arrive meanwhile wait for that same poll."""
        if self._probe is None:
            now = time.monotonic()
            stale = [e for e in self.engines if now - e.polled_at > HEALTH_MAX_AGE_S]
            if stale:
                self._probe = asyncio.ensure_future(self._poll(stale))
                self._probe.add_done_callback(self._probed)
        if self._probe is not None:
            await asyncio.shield(self._probe)
        return [e.down for e in self.engines]

    def _probed(self, probe: asyncio.Future) -> None:
        self._probe = None

    def infos(self) -> list[pb.ModelInfo | None]:
        """Each scheduler's ModelInfo as last polled (at most POLL_INTERVAL_S old), None for one out
        of rotation."""
        return [e.info if e.down is None else None for e in self.engines]

    async def poll(self) -> None:
        """Polls every scheduler in rotation, and those out of it whose backoff has passed."""
        now = time.monotonic()
        await self._poll([e for e in self.engines if e.down is None or now >= e.retry_at])

    async def _poll(self, due: list[Engine]) -> None:
        answers = await asyncio.gather(*(self._fetch(e) for e in due))
        now = time.monotonic()
        # In address order, so that of the schedulers first answering, the first listed sets the model.
        for engine, (info, error) in zip(due, answers):
            engine.polled_at = now
            self._update(engine, info, error)

    async def _poll_forever(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(POLL_INTERVAL_S)

    @staticmethod
    async def _fetch(engine: Engine) -> tuple[pb.ModelInfo | None, APIError | None]:
        # ModelInfo first: a scheduler reattaching to its executor already tells the model.
        try:
            info = await engine.client.model_info()
        except APIError as e:
            return None, e
        try:
            await engine.client.check_serving()
        except APIError as e:
            return info, e
        return info, None

    def _update(self, engine: Engine, info: pb.ModelInfo | None, error: APIError | None) -> None:
        wrong_model = self._mismatch(engine, info) if info is not None else None
        reason = error.info.message if error else wrong_model
        if reason:
            self._take_out(engine, reason)
            return
        if engine.down is not None:
            log.info("scheduler_in_rotation", engine=engine.index, address=engine.address)
        engine.info, engine.pending, engine.down, engine.backoff = info, 0, None, MIN_BACKOFF_S

    def _mismatch(self, engine: Engine, info: pb.ModelInfo) -> str | None:
        spec = ModelSpec.of(info)
        # The reference's own facts stay current: a restarted scheduler may serve a new model.
        if self._reference in (None, engine):
            self.spec, self.block_size, self._reference = spec, info.block_size, engine
        if spec == self.spec:
            return None
        log.error("scheduler_model_mismatch", address=engine.address, serves=spec,
                  reference=self._reference.address, reference_serves=self.spec,
                  message=f"the scheduler at {engine.address} serves another model than the one at "
                          f"{self._reference.address}; every --scheduler-address must serve the same model")
        return f"serves another model than engine {self._reference.index}"

    def _take_out(self, engine: Engine, reason: str) -> None:
        if engine.down is None:
            log.warning("scheduler_out_of_rotation", engine=engine.index, address=engine.address, reason=reason)
        else:
            engine.backoff = min(2 * engine.backoff, MAX_BACKOFF_S)
        engine.down = reason
        engine.retry_at = time.monotonic() + engine.backoff
