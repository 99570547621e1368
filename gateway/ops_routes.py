"""Operational routes: /health for probes, /version, and /metrics for Prometheus."""
import msgspec
from aiohttp import web

from pagedserve.gateway.errors import APIError
from pagedserve.gateway.state import GATEWAY
from pagedserve.common.version import __version__
from pagedserve.common.log import get_logger

log = get_logger(__name__)
_VERSION = msgspec.json.encode({"version": __version__})


async def health(request: web.Request) -> web.Response:
    """200 while the scheduler reports SERVING; 503 while it starts, stops, reattaches to its executor
    or is unreachable, and while this gateway shuts down."""
    await request.app[GATEWAY].engine.check_serving()
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def version_info(request: web.Request) -> web.Response:
    return web.Response(body=_VERSION, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition; the scheduler's series are fetched now, and left out while it is down."""
    gateway = request.app[GATEWAY]
    try:
        await gateway.model()
        info = await gateway.engine.model_info()
    except APIError as e:
        log.warning("metrics_without_scheduler", message=e.info.message)
        info = None
    body, content_type = gateway.metrics.render(info, request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})
