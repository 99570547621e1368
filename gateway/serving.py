"""What every generation route shares, whatever its protocol (admission and refusal counts are
admission.engine_route's): reading the body, and run(): a plan to its response, streamed or whole, under the shutdown drain,
with the request log. A protocol brings its Wire (how events look on it) and its stream writer."""
import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Protocol

import msgspec
from aiohttp import web

from pagedserve.common.log import get_logger, loggable
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.gateway.errors import APIError, internal, request_timeout, bad_request
from pagedserve.gateway.output_events import Collected, Step, collect, steps
from pagedserve.gateway.request_plan import Plan
from pagedserve.gateway.schemas import Usage, decode_request
from pagedserve.gateway.sse import SSEWriter
from pagedserve.gateway.state import GATEWAY

log = get_logger(__name__)
_encoder = msgspec.json.Encoder()


class Wire(Protocol):
    """A protocol's output side: its response id, and its messages for each part of a run."""
    id: str

    def openings(self) -> list[msgspec.Struct]: ...

    def step(self, step: Step) -> list[msgspec.Struct]: ...

    def closing(self, usage: Usage) -> list[msgspec.Struct]: ...

    def error(self, error: APIError) -> msgspec.Struct: ...

    def body(self, collected: Collected) -> msgspec.Struct: ...


class StreamWriter(Protocol):
    response: web.StreamResponse

    async def send(self, event: msgspec.Struct) -> None: ...

    async def close(self) -> None: ...


def json_response(body: msgspec.Struct, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(body), status=status, content_type="application/json")


async def read_json(request: web.Request, kind: type[msgspec.Struct], any_type: bool = False) -> msgspec.Struct:
    """The body decoded into `kind`; a 400 for the wrong Content-Type (unless `any_type`: Ollama reads
    any body as JSON, and `curl -d` sends a form's type) or a body that does not fit, a 408 for a body
    slower than --body-read-timeout."""
    if not any_type and request.content_type != "application/json":
        raise bad_request(f"Content-Type must be application/json, not '{request.content_type}'.")
    timeout = request.app[GATEWAY].body_read_timeout
    try:
        body = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise request_timeout(timeout) from None
    return decode_request(body, kind)


async def run(request: web.Request, plan: Plan, wire: Wire,
              open_stream: Callable[[web.Request], Awaitable[StreamWriter]] = SSEWriter.open) -> web.StreamResponse:
    """The plan's response: streamed through `open_stream`'s writer when the plan streams, else the
    wire's body as JSON."""
    start = time.monotonic()
    try:
        with request.app[GATEWAY].drain.track(plan.generation):
            if plan.stream:
                return await _stream(request, plan, wire, open_stream, start)
            return json_response(await whole(plan, wire, start))
    except asyncio.CancelledError:
        _client_left(wire, plan, start)
        raise


async def whole(plan: Plan, wire: Wire, start: float) -> msgspec.Struct:
    """The plan's whole output as the wire's body, logged in the request log (`start`: when it began)."""
    collected = await collect(plan)
    log_end("request_finished", wire, plan, start)
    return wire.body(collected)


async def _stream(request: web.Request, plan: Plan, wire: Wire,
                  open_stream: Callable[[web.Request], Awaitable[StreamWriter]], start: float) -> web.StreamResponse:
    async with aclosing(steps(plan)) as stepped:
        # Wait for the first text before sending headers, so that early failures get a real status code.
        first = await anext(stepped)
        writer = await open_stream(request)
        try:
            await _send(writer, wire.openings())
            await _send(writer, wire.step(first))
            async for step in stepped:
                await _send(writer, wire.step(step))
            await _send(writer, wire.closing(plan.generation.usage()))
        except ConnectionResetError:
            # The client left; closing `stepped` cancels the engine calls.
            _client_left(wire, plan, start)
            return writer.response
        except APIError as e:
            log.info("stream_failed", status=e.status, message=loggable(e.info.message))
            await writer.send(wire.error(e))
        except Exception:
            log.exception("stream_crashed")
            await writer.send(wire.error(internal()))
    await writer.close()
    log_end("request_finished", wire, plan, start)
    return writer.response


async def _send(writer: StreamWriter, events: list[msgspec.Struct]) -> None:
    for event in events:
        await writer.send(event)


def log_end(event: str, wire: Wire, plan: Plan, start: float) -> None:
    """The request log's line for a plan that ended (`start`: time.monotonic() when it began)."""
    usage = plan.generation.usage()
    summary = dict(id=wire.id, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                   elapsed_s=round(time.monotonic() - start, 3))
    request_log = plan.generation.log
    if not request_log.enabled:
        # Debug unless asked for: a line per request slows serving under load.
        log.debug(event, **summary)
        return
    choices = plan.choices
    if request_log.outputs:
        limit = request_log.max_len
        summary["outputs"] = [o.text if limit is None else loggable(o.text, limit) for o in plan.outputs]
    log.info(event, **summary, finish_reasons=[c.finish_reason for c in choices],
             params=changed_fields(choices[0].params))


def changed_fields(params: SamplingParams) -> dict:
    """The sampling parameters a request set to other than their defaults, each cut to fit a log line."""
    default = type(params)()
    return {f.name: loggable(getattr(params, f.name)) for f in dataclasses.fields(params)
            if getattr(params, f.name) != getattr(default, f.name)}


def _client_left(wire: Wire, plan: Plan, start: float) -> None:
    plan.generation.metrics.client_disconnected.inc()
    log_end("client_disconnected", wire, plan, start)
