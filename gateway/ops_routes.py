"""Operational routes: /health for probes, /version, and /metrics for Prometheus."""
import msgspec
from aiohttp import web

from pagedserve.gateway.errors import APIError, unavailable
from pagedserve.gateway.state import GATEWAY
from pagedserve.common.version import __version__
from pagedserve.common.log import get_logger

log = get_logger(__name__)
_VERSION = msgspec.json.encode({"version": __version__})


async def health(request: web.Request) -> web.Response:
    """200 while at least one scheduler reports SERVING; 503 while every one starts, stops, reattaches
    to its executor or is unreachable, and while this gateway shuts down. The states are at most
    1 s old (see EnginePool.health)."""
    states = await request.app[GATEWAY].engines.health()
    if all(states):
        if len(states) == 1:
            raise unavailable(states[0])
        # Engines by index (the order of --scheduler-address): addresses are for the logs only.
        down = " ".join(f"Engine {i}: {reason}" for i, reason in enumerate(states))
        raise unavailable(f"No scheduler is serving. {down}")
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def version_info(request: web.Request) -> web.Response:
    return web.Response(body=_VERSION, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition; each scheduler's series as the gateway last polled them (at most
    0.5 s ago: a scrape calls no scheduler), left out while it is down."""
    gateway = request.app[GATEWAY]
    try:
        await gateway.model()
        infos = gateway.engines.infos()
    except APIError as e:
        log.warning("metrics_without_scheduler", message=e.info.message)
        infos = []
    body, content_type = gateway.metrics.render(infos, request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})
