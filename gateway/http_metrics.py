"""Requests by endpoint: pagedserve:http_requests_total{handler, method, status}, counted as vLLM's
HTTP instrumentation counts them (handler: the route's path template, "unmatched" for a path no
route serves; status: its class, 2xx to 5xx). A request whose client left before an answer is
not counted here (see http_requests_client_disconnected)."""
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, Counter


def requests_middleware(registry: CollectorRegistry) -> Middleware:
    """Counts every answered request into `registry`; goes outside error_middleware, whose answers it counts."""
    requests = Counter("pagedserve:http_requests", "HTTP requests answered, by route, method and status class.",
                       ["handler", "method", "status"], registry=registry)

    @web.middleware
    async def count(request: web.Request, handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPException as e:
            requests.labels(_handler(request), request.method, f"{e.status // 100}xx").inc()
            raise
        requests.labels(_handler(request), request.method, f"{response.status // 100}xx").inc()
        return response
    return count


def _handler(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return "unmatched" if resource is None else resource.canonical
