"""OpenAI's Files API, for batch input and output: POST /v1/files (multipart, purpose=batch), GET
/v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content and DELETE /v1/files/{id}. An upload
streams to disk, within --batch-max-file-mb and MAX_LINES lines."""
from pathlib import Path

from aiohttp import BodyPartReader, web

from pagedserve.gateway.batch_runner import runner_of
from pagedserve.gateway.batch_schemas import FileDeleted, FileObject, Page
from pagedserve.gateway.errors import APIError, bad_request
from pagedserve.gateway.serving import json_response

# OpenAI's limit on a batch input file.
MAX_LINES = 50_000
_CHUNK = 1 << 16
MAX_PAGE = 10_000


async def upload(request: web.Request) -> web.Response:
    runner = runner_of(request)
    reader = await _multipart(request)
    purpose, stored = None, None
    try:
        while (part := await reader.next()) is not None:
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                stored = await _save(part, runner.store.upload_path(), runner.max_file_bytes)
        if stored is None:
            raise bad_request("No `file` part: upload the JSONL file as the multipart field `file`.", param="file")
        if purpose != "batch":
            raise bad_request(f"`purpose` is {purpose!r}; this server takes files for purpose 'batch' only.",
                              param="purpose")
        return json_response(await runner.store.add_file(stored[0], stored[1], purpose))
    finally:
        if stored is not None:
            stored[0].unlink(missing_ok=True)


async def _multipart(request: web.Request):
    if request.content_type != "multipart/form-data":
        raise bad_request(f"Content-Type must be multipart/form-data, not '{request.content_type}'; send the file "
                          "and its purpose as a form.")
    return await request.multipart()


async def _save(part: BodyPartReader, path: Path, max_bytes: int) -> tuple[Path, str]:
    """The part written to `path`, and its file name; a 413 past `max_bytes`, a 400 past MAX_LINES lines."""
    size = lines = 0
    try:
        with open(path, "wb") as out:
            while chunk := await part.read_chunk(_CHUNK):
                size += len(chunk)
                lines += chunk.count(b"\n")
                if size > max_bytes:
                    raise APIError(413, f"The file is larger than {max_bytes >> 20} MiB, this server's limit "
                                   "(--batch-max-file-mb); split it into several batches.", param="file")
                if lines > MAX_LINES:
                    raise bad_request(f"The file has more than {MAX_LINES} lines, a batch's limit; split it into "
                                      "several batches.", param="file")
                out.write(chunk)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path, part.filename or "upload.jsonl"


async def list_files(request: web.Request) -> web.Response:
    """The files, newest first unless order=asc, `limit` (1-10000, default all) at a time after `after`."""
    query = request.query
    after, limit = page_args(request, MAX_PAGE, MAX_PAGE)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("`order` must be 'asc' or 'desc'.", param="order")
    files = await runner_of(request).store.files(after, limit + 1, order == "desc", query.get("purpose"))
    return json_response(page(files, limit))


async def get_file(request: web.Request) -> web.Response:
    return json_response(await _file(request))


async def file_content(request: web.Request) -> web.FileResponse:
    file = await _file(request)
    return web.FileResponse(runner_of(request).store.file_path(file.id),
                            headers={"Content-Type": "application/octet-stream"})


async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    if not await runner_of(request).store.delete_file(file_id):
        raise _no_file(file_id)
    return json_response(FileDeleted(file_id))


async def _file(request: web.Request) -> FileObject:
    file_id = request.match_info["file_id"]
    file = await runner_of(request).store.file(file_id)
    if file is None:
        raise _no_file(file_id)
    return file


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}.", param="file_id", code="file_not_found")


def page_args(request: web.Request, default_limit: int, max_limit: int) -> tuple[str | None, int]:
    """OpenAI's `after` (an id) and `limit` (1 to `max_limit`) of a list request."""
    query = request.query
    try:
        limit = int(query.get("limit", default_limit))
    except ValueError:
        limit = 0
    if not 1 <= limit <= max_limit:
        raise bad_request(f"`limit` must be an integer from 1 to {max_limit}.", param="limit")
    return query.get("after"), limit


def page(found: list, limit: int) -> Page:
    """OpenAI's list of the first `limit` of `found` (fetched one past the limit, which tells has_more)."""
    data = found[:limit]
    return Page(data, len(found) > limit, data[0].id if data else None, data[-1].id if data else None)

