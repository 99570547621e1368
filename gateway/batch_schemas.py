"""The Files and Batch APIs' objects as OpenAI writes them, and the lines of batch input and output files."""
from typing import Literal

import msgspec
from msgspec import Struct

# Statuses a batch leaves only by running on; the others are final.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]


class FileObject(Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(Struct):
    id: str
    deleted: bool = True
    object: str = "file"


class BatchError(Struct, kw_only=True):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(Struct):
    data: list[BatchError]
    object: str = "list"


class RequestCounts(Struct):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(Struct, kw_only=True):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    object: str = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class Page(Struct):
    """OpenAI's list: the objects, the first and last ids of the page, and whether more follow."""
    data: list[FileObject] | list[Batch]
    has_more: bool
    first_id: str | None
    last_id: str | None
    object: str = "list"


class BatchCreate(Struct, kw_only=True, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


class InputLine(Struct, kw_only=True):
    """One request of a batch input file; the body stays raw JSON until its line runs."""
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class LineResponse(Struct):
    status_code: int
    request_id: str
    body: msgspec.Raw


class LineError(Struct):
    code: str
    message: str


class OutputLine(Struct):
    """One line of a batch's output or error file."""
    id: str
    custom_id: str
    response: LineResponse | None
    error: LineError | None
