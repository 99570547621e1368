"""What every engine route checks before it runs: the model it names, the concurrency limit, the
model's runner, and the count of what it refuses."""
import functools
from collections.abc import Awaitable, Callable
from contextlib import suppress

from aiohttp import web

from pagedserve.gateway.errors import APIError, bad_request, overloaded
from pagedserve.gateway.metrics import rejection_reason
from pagedserve.gateway.state import GATEWAY, SERVED, ServedModel

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The flag that makes an engine serve the other kind of route.
_RUNNER_FLAG = {"generate": "--runner generate", "pooling": "--runner pooling"}


async def served_for(request: web.Request, model: str | None) -> ServedModel:
    """Gateway.served_for, remembered on the request so that its rejections count under its name."""
    served = await request.app[GATEWAY].served_for(model)
    request[SERVED] = served
    return served


def counts_rejections(handler: Handler) -> Handler:
    """Counts what an engine route refuses before running, as request_rejected{reason}."""
    @functools.wraps(handler)
    async def counted(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except (APIError, web.HTTPException) as e:
            reason = rejection_reason(e.status, e.info.code if isinstance(e, APIError) else None)
            if reason is not None:
                # Until the scheduler has answered once, the model name (the label) is unknown; with
                # several models, so is the model of a request refused before naming one.
                with suppress(APIError):
                    served = request.get(SERVED) or await request.app[GATEWAY].served_for(None)
                    served.metrics.request_rejected[reason].inc()
            raise
    return counted


def admitted(handler: Handler) -> Handler:
    """Answers 503 server_overloaded while --max-concurrent-requests engine requests are in flight."""
    @functools.wraps(handler)
    async def admitted(request: web.Request) -> web.StreamResponse:
        gateway = request.app[GATEWAY]
        limit = gateway.max_concurrent_requests
        if limit is not None and gateway.generating >= limit:
            raise overloaded(f"This server already serves {limit} requests, its limit "
                             "(--max-concurrent-requests); retry shortly.")
        gateway.generating += 1
        try:
            return await handler(request)
        finally:
            gateway.generating -= 1
    return admitted


def engine_route(handler: Handler) -> Handler:
    """A route that runs on the engine (generation or pooling): its refusals counted, past the
    admission limit a 503."""
    return counts_rejections(admitted(handler))


def check_runner(served: ServedModel, runner: str, endpoint: str) -> None:
    """400 when the model's engine runs another runner than `endpoint` needs."""
    if served.spec.runner != runner:
        raise bad_request(f"The model `{served.name}` runs with --runner {served.spec.runner}, which does not "
                          f"serve {endpoint}; serve a model started with {_RUNNER_FLAG[runner]} for it.",
                          param="model")
