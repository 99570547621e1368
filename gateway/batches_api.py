"""OpenAI's Batch API: POST /v1/batches, GET /v1/batches, GET /v1/batches/{id} and POST
/v1/batches/{id}/cancel. The batch runner (batch_runner) does the work."""
import time

from aiohttp import web

from pagedserve.gateway.batch_runner import runner_of
from pagedserve.gateway.batch_lines import ENDPOINTS
from pagedserve.gateway.batch_schemas import Batch, BatchCreate
from pagedserve.gateway.batch_store import new_id
from pagedserve.gateway.errors import APIError, bad_request
from pagedserve.gateway.files_api import page, page_args
from pagedserve.gateway.serving import json_response, read_json

# The only completion window OpenAI takes.
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
# OpenAI's bounds on metadata.
_MAX_METADATA = 16


async def create_batch(request: web.Request) -> web.Response:
    req = await read_json(request, BatchCreate)
    runner = runner_of(request)
    _check(req)
    file = await runner.store.file(req.input_file_id)
    if file is None or file.purpose != "batch":
        raise bad_request(f"No input file {req.input_file_id} of purpose 'batch'; upload it with POST /v1/files "
                          "first.", param="input_file_id")
    now = int(time.time())
    batch = Batch(id=new_id("batch_"), endpoint=req.endpoint, input_file_id=file.id,
                  completion_window=req.completion_window, status="validating", created_at=now,
                  expires_at=now + COMPLETION_WINDOW_S[req.completion_window], metadata=req.metadata)
    await runner.store.save_batch(batch)
    runner.submit(batch.id)
    return json_response(batch)


def _check(req: BatchCreate) -> None:
    if req.endpoint not in ENDPOINTS:
        raise bad_request(f"`endpoint` {req.endpoint!r} cannot run in a batch; use one of {', '.join(ENDPOINTS)}.",
                          param="endpoint")
    if req.completion_window not in COMPLETION_WINDOW_S:
        raise bad_request(f"`completion_window` {req.completion_window!r} is not supported; use '24h'.",
                          param="completion_window")
    if req.metadata is not None and len(req.metadata) > _MAX_METADATA:
        raise bad_request(f"`metadata` has more than {_MAX_METADATA} keys.", param="metadata")


async def list_batches(request: web.Request) -> web.Response:
    """The batches, newest first, `limit` (1-100, default 20) at a time after `after`."""
    after, limit = page_args(request, 20, 100)
    return json_response(page(await runner_of(request).store.batches(after, limit + 1), limit))


async def get_batch(request: web.Request) -> web.Response:
    return json_response(await _batch(request))


async def cancel_batch(request: web.Request) -> web.Response:
    return json_response(await runner_of(request).cancel(await _batch(request)))


async def _batch(request: web.Request) -> Batch:
    batch_id = request.match_info["batch_id"]
    batch = await runner_of(request).store.batch(batch_id)
    if batch is None:
        raise APIError(404, f"No such Batch object: {batch_id}.", param="batch_id", code="batch_not_found")
    return batch
