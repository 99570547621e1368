"""`background: true` on /v1/responses: the request is answered at once with the response queued,
and the output is made by a task of the gateway's. The stored response shows its progress (queued,
in_progress, then completed, incomplete, failed or cancelled); POST /v1/responses/{id}/cancel
stops it, aborting its engine request. Background work counts against --max-concurrent-requests
while it runs; at shutdown what is still running is cancelled."""
import asyncio
import functools
import time

from pagedserve.common.log import get_logger, loggable
from pagedserve.gateway.errors import APIError, internal
from pagedserve.gateway.output_events import collect
from pagedserve.gateway.request_plan import Plan
from pagedserve.gateway.response_store import ResponseStore
from pagedserve.gateway.responses_output import ResponsesOutput
from pagedserve.gateway.responses_schemas import ErrorDetails, Response
from pagedserve.gateway.serving import log_end
from pagedserve.gateway.state import Gateway

log = get_logger(__name__)


def start(gateway: Gateway, plan: Plan, output: ResponsesOutput) -> Response:
    """Stores the response queued and starts making it; returns it as it stands."""
    output.response.status = "queued"
    output.finished(output.response)
    task = asyncio.create_task(_make(gateway, plan, output))
    gateway.responses.running[output.id] = task
    task.add_done_callback(functools.partial(_done, gateway.responses.running, output))
    return output.response


async def cancel(store: ResponseStore, response_id: str) -> bool:
    """Stops a background response still running; False when none by that id runs."""
    task = store.running.get(response_id)
    if task is None:
        return False
    task.cancel()
    await asyncio.wait([task])
    return True


async def _make(gateway: Gateway, plan: Plan, output: ResponsesOutput) -> None:
    started = time.monotonic()
    gateway.generating += 1
    try:
        with gateway.drain.track(plan.generation):
            output.response.status = "in_progress"
            output.body(await collect(plan))
        log_end("request_finished", output, plan, started)
    except asyncio.CancelledError:
        log_end("background_cancelled", output, plan, started)
        raise
    except APIError as e:
        log.info("background_failed", status=e.status, message=loggable(e.info.message))
        _ended(output, "failed", e)
    except Exception:
        log.exception("background_crashed")
        _ended(output, "failed", internal())
    finally:
        gateway.generating -= 1


def _done(running: dict[str, asyncio.Task], output: ResponsesOutput, task: asyncio.Task) -> None:
    # Here rather than in _make: a task cancelled before it first runs never enters it.
    running.pop(output.id, None)
    if task.cancelled():
        _ended(output, "cancelled")


def _ended(output: ResponsesOutput, status: str, error: APIError | None = None) -> None:
    response = output.response
    response.status = status
    if error is not None:
        response.error = ErrorDetails(error.info.code or error.info.type, error.info.message)
    output.finished(response)
