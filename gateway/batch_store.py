"""The Batch API's durable state: an SQLite database (WAL) and a folder of files under --batch-dir.

Tables: files (uploaded inputs, written outputs), batches (each batch object as JSON) and lines
(one row per input line of a running batch, with its output line once answered). A line is answered
once: its row is updated only while unanswered, and each answer is committed as it comes, so a
gateway killed mid-batch resumes with the lines still unanswered. Every database call runs on one
thread of its own, off the event loop."""
import asyncio
import fcntl
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import msgspec

from pagedserve.gateway.batch_schemas import ACTIVE, Batch, FileObject

T = TypeVar("T")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, object TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, status TEXT NOT NULL, object TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL, body BLOB NOT NULL,
    result BLOB, failed INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, line_no));
"""


class BatchDirInUse(Exception):
    pass


def default_batch_dir() -> Path:
    """$XDG_DATA_HOME/pagedserve/batches, else ~/.local/share/pagedserve/batches."""
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "pagedserve" / "batches"


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class BatchStore:
    """The database and the file folder of one --batch-dir."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self._db: sqlite3.Connection | None = None
        self._lock = None
        self._thread = ThreadPoolExecutor(1, "batch-store")

    async def open(self) -> None:
        """Creates the folder and schema if new, and removes files no row names (a write cut short)."""
        await self._call(self._open)

    async def close(self) -> None:
        if self._db is not None:
            await self._call(self._db.close)
            self._lock.close()
        self._thread.shutdown()

    def _open(self) -> None:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # One gateway per folder: a second would run the same batches again, and take another's
        # upload in progress for an orphan.
        self._lock = open(self.root / "lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise BatchDirInUse(f"another pagedserve gateway uses the batch folder {self.root}") from None
        self._db = sqlite3.connect(self.root / "batches.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # With WAL, NORMAL loses no committed line when the process dies, only when the machine does.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        known = {row[0] for row in self._db.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink()

    async def _call(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def upload_path(self) -> Path:
        """A new path in the file folder for an upload that add_file() then names."""
        return self.files_dir / new_id("upload-")

    async def add_file(self, uploaded: Path, filename: str, purpose: str) -> FileObject:
        """Registers the file written at `uploaded` (from upload_path) under a new id."""
        file = FileObject(id=new_id("file-"), bytes=uploaded.stat().st_size, created_at=int(time.time()),
                          filename=filename, purpose=purpose)
        await self._call(self._add_file, uploaded, file)
        return file

    def _add_file(self, uploaded: Path, file: FileObject) -> None:
        uploaded.rename(self.file_path(file.id))
        with self._db:
            self._db.execute("INSERT INTO files VALUES (?, ?)", (file.id, msgspec.json.encode(file)))

    async def file(self, file_id: str) -> FileObject | None:
        row = await self._call(self._one, "SELECT object FROM files WHERE id = ?", (file_id,))
        return None if row is None else msgspec.json.decode(row[0], type=FileObject)

    async def files(self, after: str | None, limit: int, newest_first: bool,
                    purpose: str | None) -> list[FileObject]:
        """Up to `limit` files after the one with id `after`, in upload order or its reverse."""
        where, args = _after("files", after, newest_first)
        if purpose is not None:
            where, args = where + " AND json_extract(object, '$.purpose') = ?", [*args, purpose]
        order = "DESC" if newest_first else "ASC"
        rows = await self._call(self._all, f"SELECT object FROM files WHERE {where} ORDER BY rowid {order} LIMIT ?",
                                (*args, limit))
        return [msgspec.json.decode(row[0], type=FileObject) for row in rows]

    async def delete_file(self, file_id: str) -> bool:
        return await self._call(self._delete_file, file_id)

    def _delete_file(self, file_id: str) -> bool:
        with self._db:
            deleted = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        self.file_path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    async def save_batch(self, batch: Batch) -> None:
        await self._call(self._save_batch, batch)

    def _save_batch(self, batch: Batch) -> None:
        with self._db:
            # An upsert, not a replace, which would give the row a new rowid: lists go by rowid.
            self._db.execute("INSERT INTO batches VALUES (?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                             "status = excluded.status, object = excluded.object",
                             (batch.id, batch.status, msgspec.json.encode(batch)))

    async def batch(self, batch_id: str) -> Batch | None:
        """The batch, with its line counts as they stand while it runs."""
        return await self._call(self._batch, batch_id)

    def _batch(self, batch_id: str) -> Batch | None:
        row = self._one("SELECT object FROM batches WHERE id = ?", (batch_id,))
        return None if row is None else self._counted(msgspec.json.decode(row[0], type=Batch))

    def _counted(self, batch: Batch) -> Batch:
        if batch.status in ("in_progress", "finalizing", "cancelling"):
            total, answered, failed = self._one("SELECT count(*), count(result), coalesce(sum(failed), 0) FROM lines "
                                                "WHERE batch_id = ?", (batch.id,))
            counts = batch.request_counts
            counts.total, counts.completed, counts.failed = total, answered - failed, failed
        return batch

    async def batches(self, after: str | None, limit: int) -> list[Batch]:
        """Up to `limit` batches created before the one with id `after`, newest first."""
        return await self._call(self._batches, after, limit)

    def _batches(self, after: str | None, limit: int) -> list[Batch]:
        where, args = _after("batches", after, True)
        rows = self._all(f"SELECT object FROM batches WHERE {where} ORDER BY rowid DESC LIMIT ?", (*args, limit))
        return [self._counted(msgspec.json.decode(row[0], type=Batch)) for row in rows]

    async def unfinished(self) -> list[str]:
        """The ids of batches with work left, oldest first."""
        rows = await self._call(self._all, "SELECT id FROM batches WHERE status IN (?, ?, ?, ?) ORDER BY rowid",
                                ACTIVE)
        return [row[0] for row in rows]

    async def start_lines(self, batch: Batch, lines: Iterable[tuple[int, str, bytes]]) -> None:
        """Stores the input lines (line number, custom_id, body) and the batch, now in progress, at once."""
        await self._call(self._start_lines, batch, list(lines))

    def _start_lines(self, batch: Batch, lines: list[tuple[int, str, bytes]]) -> None:
        with self._db:
            self._db.execute("DELETE FROM lines WHERE batch_id = ?", (batch.id,))
            self._db.executemany("INSERT INTO lines (batch_id, line_no, custom_id, body) VALUES (?, ?, ?, ?)",
                                 [(batch.id, *line) for line in lines])
            self._db.execute("UPDATE batches SET status = ?, object = ? WHERE id = ?",
                             (batch.status, msgspec.json.encode(batch), batch.id))

    async def unanswered(self, batch_id: str) -> list[tuple[int, str, bytes]]:
        """The lines (line number, custom_id, body) with no answer yet, in order."""
        return await self._call(self._all, "SELECT line_no, custom_id, body FROM lines WHERE batch_id = ? AND "
                                "result IS NULL ORDER BY line_no", (batch_id,))

    async def answer(self, batch_id: str, line_no: int, result: bytes, failed: bool) -> bool:
        """Records a line's output line; False (and nothing changed) when it had one already."""
        return await self._call(self._answer, batch_id, line_no, result, failed)

    def _answer(self, batch_id: str, line_no: int, result: bytes, failed: bool) -> bool:
        with self._db:
            return bool(self._db.execute("UPDATE lines SET result = ?, failed = ? WHERE batch_id = ? AND "
                                         "line_no = ? AND result IS NULL",
                                         (result, int(failed), batch_id, line_no)).rowcount)

    async def finalize(self, batch: Batch, status: str, unanswered: Callable[[str], bytes] | None) -> Batch:
        """Ends the batch with `status`: writes its output file (answered lines) and error file (failed
        lines, then each unanswered line as `unanswered(custom_id)` makes it, unless None), sets its counts,
        and drops its lines. A batch ended already is returned as it is: finalizing twice writes once."""
        return await self._call(self._finalize, batch.id, status, unanswered)

    def _finalize(self, batch_id: str, status: str, unanswered: Callable[[str], bytes] | None) -> Batch:
        batch = self._batch(batch_id)
        if batch.status not in ACTIVE:
            return batch
        now = int(time.time())
        ok = self._write_file(batch, "output", "result IS NOT NULL AND failed = 0", None)
        failed = self._write_file(batch, "error", "result IS NULL OR failed = 1", unanswered)
        counts = batch.request_counts
        counts.failed += counts.total - counts.completed - counts.failed if unanswered else 0
        batch.output_file_id, batch.error_file_id = ok and ok.id, failed and failed.id
        batch.status = status
        setattr(batch, f"{status}_at", now)
        with self._db:
            for file in (ok, failed):
                if file is not None:
                    self._db.execute("INSERT INTO files VALUES (?, ?)", (file.id, msgspec.json.encode(file)))
            self._db.execute("UPDATE batches SET status = ?, object = ? WHERE id = ?",
                             (status, msgspec.json.encode(batch), batch_id))
            self._db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
        return batch

    def _write_file(self, batch: Batch, kind: str, where: str,
                    unanswered: Callable[[str], bytes] | None) -> FileObject | None:
        """The output lines matching `where` written to a new file; None when there are none."""
        file_id = new_id("file-")
        path, written = self.file_path(file_id), 0
        rows = self._db.execute(f"SELECT custom_id, result FROM lines WHERE batch_id = ? AND ({where}) "
                                "ORDER BY line_no", (batch.id,))
        with open(path, "wb") as out:
            for custom_id, result in rows:
                if result is None and unanswered is None:
                    continue
                out.write((result if result is not None else unanswered(custom_id)) + b"\n")
                written += 1
            out.flush()
            os.fsync(out.fileno())
        if not written:
            path.unlink()
            return None
        return FileObject(id=file_id, bytes=path.stat().st_size, created_at=int(time.time()),
                          filename=f"{batch.id}_{kind}.jsonl", purpose="batch_output")

    def _one(self, sql: str, args: tuple) -> tuple | None:
        return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple) -> list[tuple]:
        return self._db.execute(sql, args).fetchall()


def _after(table: str, after: str | None, newest_first: bool) -> tuple[str, list]:
    """The WHERE clause of a page that starts past the row with id `after` (all rows without one)."""
    if after is None:
        return "1", []
    return f"rowid {'<' if newest_first else '>'} coalesce((SELECT rowid FROM {table} WHERE id = ?), -1)", [after]
