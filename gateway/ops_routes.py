"""Operational routes: /health for probes, /load for balancers, /version, and /metrics for Prometheus."""
import asyncio

import msgspec
from aiohttp import web

from pagedserve.gateway.errors import APIError, unavailable
from pagedserve.gateway.state import GATEWAY
from pagedserve.common.version import __version__
from pagedserve.common.log import get_logger

log = get_logger(__name__)
_VERSION = msgspec.json.encode({"version": __version__})


async def health(request: web.Request) -> web.Response:
    """200 while at least one scheduler, of any model, reports SERVING; 503 while every one starts,
    stops, reattaches to its executor or is unreachable, and while this gateway shuts down. The
    states are at most 1 s old (see EnginePool.health)."""
    models = await asyncio.gather(*(m.engines.health() for m in request.app[GATEWAY].models))
    if all(all(states) for states in models):
        raise unavailable(_none_serving(models))
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


def _none_serving(models: list[list[str]]) -> str:
    """Why no scheduler serves: engines by index (the order of --scheduler-address), and with several
    models by model index too (0 the main model, then --also-serve's order); addresses are for the logs only."""
    if len(models) == 1 and len(models[0]) == 1:
        return models[0][0]
    prefix = "Engine" if len(models) == 1 else "Model {m} engine"
    down = " ".join(f"{prefix.format(m=m)} {i}: {reason}" for m, states in enumerate(models)
                    for i, reason in enumerate(states))
    return f"No scheduler is serving. {down}"


async def load(request: web.Request) -> web.Response:
    """vLLM's /load: the engine requests (generation and pooling) in flight on this gateway, which a
    load balancer can route by."""
    return web.json_response({"server_load": request.app[GATEWAY].generating})


async def version_info(request: web.Request) -> web.Response:
    return web.Response(body=_VERSION, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition; each scheduler's series as the gateway last polled them (at most
    0.5 s ago: a scrape calls no scheduler), left out while it is down."""
    gateway = request.app[GATEWAY]
    try:
        infos = [(served.name, served.engines.infos()) for served in await gateway.served_models()]
    except APIError as e:
        log.warning("metrics_without_scheduler", message=e.info.message)
        infos = []
    body, content_type = gateway.metrics.render(infos, request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})
