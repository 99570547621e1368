"""The gateway's batch runner: a task per batch with work left, all sharing --batch-concurrency
line slots. A batch is checked (validating), its lines run as background requests through the same
translation as their endpoint's route, each answer stored as it comes (in_progress), then its output
and error files are written (finalizing, completed). A line the server turns away for now (503,
429: overloaded, a scheduler down, shutting down) is retried, never failed. Past its
completion_window a batch expires: what is unanswered goes to its error file. On start, every
batch a stopped gateway left unfinished resumes with its unanswered lines."""
import asyncio
import time
from contextlib import suppress

import msgspec
from aiohttp import web

from pagedserve.common.log import get_logger, loggable
from pagedserve.gateway import batch_lines
from pagedserve.gateway.batch_schemas import ACTIVE, Batch, BatchError, BatchErrors
from pagedserve.gateway.batch_store import BatchDirInUse, BatchStore, new_id
from pagedserve.gateway.errors import APIError, internal, unavailable
from pagedserve.gateway.request_id import bound_request_id
from pagedserve.gateway.state import Gateway

log = get_logger(__name__)
DEFAULT_CONCURRENCY = 256
# OpenAI's limit on a batch input file.
DEFAULT_MAX_FILE_MB = 200
# Statuses of a refusal that says "later", after which a line is sent again.
_RETRIED = (429, 503)
_RETRY_S = 1.0
# How often a gateway whose batch folder another holds tries to take it.
_REOPEN_S = 5.0
# The status a batch ends with, by the status it stopped in.
_FINAL = {"in_progress": "completed", "finalizing": "completed", "cancelling": "cancelled"}


class BatchRunner:
    """Runs the batches of one store on the gateway's engines."""

    def __init__(self, gateway: Gateway, store: BatchStore, concurrency: int = DEFAULT_CONCURRENCY,
                 max_file_bytes: int = DEFAULT_MAX_FILE_MB << 20) -> None:
        self.gateway = gateway
        self.store = store
        # The largest upload taken (--batch-max-file-mb).
        self.max_file_bytes = max_file_bytes
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: dict[str, asyncio.Task] = {}
        self._metrics = gateway.metrics.batch
        # Why the batch routes answer 503 (None: they serve), and the task waiting for the store then.
        self.unavailable: str | None = None
        self._opening: asyncio.Task | None = None

    async def start(self) -> None:
        """Opens the store and resumes every batch left unfinished. While another gateway holds the
        store's folder (one being replaced, still draining), the batch routes answer 503 and the
        store is tried again every few seconds; for good where the folder cannot be written."""
        try:
            await self.store.open()
        except BatchDirInUse as e:
            self.unavailable = (f"The Batch and Files APIs are off on this server for now: {e}; retry once it "
                                "has stopped, or start this one with a --batch-dir of its own.")
            log.warning("batch_dir_in_use", reason=str(e))
            self._opening = asyncio.create_task(self._open_later())
            return
        except OSError as e:
            # Serving the other routes still: the default folder may sit in a read-only home.
            self.unavailable = (f"The Batch and Files APIs are off on this server: its batch folder "
                                f"{self.store.root} cannot be used ({e.strerror}); start it with a writable "
                                "--batch-dir.")
            log.warning("batch_api_off", batch_dir=str(self.store.root), reason=str(e))
            return
        await self._resume()

    async def _open_later(self) -> None:
        while True:
            await asyncio.sleep(_REOPEN_S)
            with suppress(BatchDirInUse):
                await self.store.open()
                break
        self.unavailable = None
        log.info("batch_dir_taken", batch_dir=str(self.store.root))
        await self._resume()

    async def _resume(self) -> None:
        for batch_id in await self.store.unfinished():
            log.info("batch_resumed", batch_id=batch_id)
            self.submit(batch_id)

    async def stop(self) -> None:
        """Stops every batch where it stands (its unanswered lines wait for the next start)."""
        tasks = list(self._tasks.values()) + ([self._opening] if self._opening else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.store.close()

    def submit(self, batch_id: str) -> None:
        """Starts running the batch, as its status says."""
        task = asyncio.create_task(self._run(batch_id))
        self._tasks[batch_id] = task
        task.add_done_callback(lambda done: self._tasks.pop(batch_id) if self._tasks.get(batch_id) is done else None)

    async def cancel(self, batch: Batch) -> Batch:
        """Stops the batch's lines and ends it cancelled, with what it answered; a 409 APIError once
        it is past running."""
        if batch.status not in ("validating", "in_progress"):
            raise APIError(409, f"Batch {batch.id} is {batch.status}; only a validating or in-progress batch "
                           "can be cancelled.", code="batch_not_cancellable")
        task = self._tasks.get(batch.id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        batch = await self.store.batch(batch.id)
        if batch.status in ("validating", "in_progress"):
            batch.status, batch.cancelling_at = "cancelling", int(time.time())
            await self.store.save_batch(batch)
        if batch.status in ACTIVE:
            self.submit(batch.id)
        return batch

    async def _run(self, batch_id: str) -> None:
        batch = await self.store.batch(batch_id)
        try:
            if batch.status == "validating":
                batch = await self._validate(batch)
            final = _FINAL.get(batch.status)
            if batch.status == "in_progress":
                final = await self._run_lines(batch)
            if final is not None:
                await self._finalize(batch, final)
        except Exception:
            log.exception("batch_crashed", batch_id=batch_id)
            await self.store.finalize(batch, "failed", None)

    async def _validate(self, batch: Batch) -> Batch:
        """The batch in progress with its lines stored, or failed with what is wrong with its input."""
        file = await self.store.file(batch.input_file_id)
        if file is None:
            return await self._failed(batch, [BatchError(
                code="file_not_found", message=f"The input file {batch.input_file_id} was deleted.",
                param="input_file_id")])
        path = self.store.file_path(file.id)
        lines, errors = await self.gateway.in_pool(batch_lines.read_input, path, batch.endpoint)
        if errors:
            return await self._failed(batch, errors)
        batch.status, batch.in_progress_at = "in_progress", int(time.time())
        batch.request_counts.total = len(lines)
        await self.store.start_lines(batch, lines)
        log.info("batch_started", batch_id=batch.id, lines=len(lines), endpoint=batch.endpoint)
        return batch

    async def _failed(self, batch: Batch, errors: list[BatchError]) -> Batch:
        batch.status, batch.failed_at, batch.errors = "failed", int(time.time()), BatchErrors(errors)
        await self.store.save_batch(batch)
        log.info("batch_invalid", batch_id=batch.id, errors=len(errors), first=loggable(errors[0].message))
        return batch

    async def _run_lines(self, batch: Batch) -> str:
        """Runs the unanswered lines, up to the batch's expiry; "completed" when every one has an
        answer, "expired" when time ran out first."""
        lines = await self.store.unanswered(batch.id)
        queued = self._metrics.lines["queued"]
        queued.inc(len(lines))
        running: set[asyncio.Task] = set()
        started = 0
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + batch.expires_at - time.time()):
                for line in lines:
                    await self._slots.acquire()
                    started += 1
                    queued.dec()
                    task = asyncio.create_task(self._line(batch, *line))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    # Here, not in _line: a task cancelled before it first runs never enters it.
                    task.add_done_callback(lambda _: self._slots.release())
                while running:
                    await asyncio.wait(running)
            return "completed"
        except TimeoutError:
            return "expired"
        finally:
            queued.dec(len(lines) - started)
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running)

    async def _line(self, batch: Batch, line_no: int, custom_id: str, body: bytes) -> None:
        request_id = new_id("batch_req_")
        with bound_request_id(request_id, batch_id=batch.id, custom_id=custom_id):
            running = self._metrics.lines["running"]
            running.inc()
            try:
                result, failed = await self._answer(batch.endpoint, custom_id, request_id, body)
            finally:
                running.dec()
        await self.store.answer(batch.id, line_no, result, failed)

    async def _answer(self, endpoint: str, custom_id: str, request_id: str, body: bytes) -> tuple[bytes, bool]:
        """The line's output line and whether it failed, once the server has taken it."""
        while True:
            try:
                out = await batch_lines.respond(self.gateway, endpoint, body)
                self._count_tokens(out)
                return batch_lines.answered(custom_id, request_id, out), False
            except APIError as e:
                if e.status not in _RETRIED:
                    log.info("batch_line_failed", status=e.status, message=loggable(e.info.message))
                    return batch_lines.refused(custom_id, request_id, e), True
                log.debug("batch_line_deferred", status=e.status, message=loggable(e.info.message))
            except Exception:
                log.exception("batch_line_crashed")
                return batch_lines.refused(custom_id, request_id, internal()), True
            await asyncio.sleep(_RETRY_S)

    def _count_tokens(self, out: msgspec.Struct) -> None:
        usage = out.usage
        self._metrics.prompt_tokens.inc(usage.prompt_tokens)
        self._metrics.generation_tokens.inc(getattr(usage, "completion_tokens", 0))

    async def _finalize(self, batch: Batch, final: str) -> None:
        if batch.status == "in_progress":
            batch.status, batch.finalizing_at = "finalizing", int(time.time())
            await self.store.save_batch(batch)
        batch = await self.store.finalize(batch, final, batch_lines.expired if final == "expired" else None)
        counts = batch.request_counts
        log.info("batch_finished", batch_id=batch.id, status=batch.status, total=counts.total,
                 completed=counts.completed, failed=counts.failed)


BATCHES = web.AppKey("batches", BatchRunner)


def runner_of(request: web.Request) -> BatchRunner:
    """The app's batch runner; a 503 while its store is off."""
    runner = request.app[BATCHES]
    if runner.unavailable is not None:
        raise unavailable(runner.unavailable)
    return runner
