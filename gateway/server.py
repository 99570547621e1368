"""Gateway entry point: flags, startup and graceful shutdown."""
import argparse
import gc
import json
import os
import resource

from aiohttp import web

from pagedserve.common import aio, service
from pagedserve.common.config import add_engine_args
from pagedserve.gateway.app import build_app
from pagedserve.gateway.state import DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_MAX_CLIENT_BATCH_SIZE, GATEWAY
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.common.log import get_logger

log = get_logger(__name__)

# In-flight requests get this long to finish after SIGTERM before they end with an error.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
# vLLM's (uvicorn's) keep-alive default.
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0
# A burst of connections waits in the kernel's queue rather than being reset (the default is 128).
LISTEN_BACKLOG = 2048


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    """Adds the gateway's flags; the model directory stays the caller's positional argument."""
    g = parser.add_argument_group("gateway")
    g.add_argument("--scheduler-address", default="127.0.0.1:50051",
                   help="the scheduler's Engine gRPC address: host:port or unix:///path")
    # The scheduler reports its served name; the gateway's flag, when given, overrides it.
    add_engine_args(parser, ("served_model_name",))
    add_serving_args(g)


def add_serving_args(group: argparse._ActionsContainer) -> None:
    """Listening, API key, CORS and streaming flags, shared with `pagedserve serve`."""
    group.add_argument("--tokenizer", default=None,
                       help="a Hugging Face tokenizer directory (or .gguf file) instead of the model's")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                       help="require `Authorization: Bearer KEY` on every route but /health (and "
                            "/metrics); defaults to $PAGEDSERVE_API_KEY, which, unlike a flag, process "
                            "listings do not show")
    group.add_argument("--protect-metrics", action="store_true", help="require the API key on /metrics too")
    group.add_argument("--allowed-origins", type=parse_origins, default=[],
                       help="CORS: origins browsers may call the API from, comma-separated or a JSON list; "
                            "* allows any")
    group.add_argument("--stream-interval", type=int, default=1,
                       help="tokens per streamed chunk; more means fewer writes under load (vLLM's flag)")
    group.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                       help="seconds running requests get to finish after SIGTERM/SIGINT; then streams end "
                            "with an error event and `data: [DONE]`, other requests with a 503")
    group.add_argument("--max-client-batch-size", type=int, default=DEFAULT_MAX_CLIENT_BATCH_SIZE,
                       help="most completions one request may ask for (prompts x n); more is a 400")
    group.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                       help="seconds a connection may stay idle, or take to send a request's headers, "
                            "before it is closed")
    group.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT_S,
                       help="seconds a request body may take to arrive; slower ones get a 408")


def parse_origins(value: str) -> list[str]:
    """A JSON list (vLLM's form) or a comma-separated list."""
    if value.lstrip().startswith("["):
        return [str(o) for o in json.loads(value)]
    return [o.strip() for o in value.split(",") if o.strip()]


async def start(app: web.Application, host: str, port: int,
                timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S) -> web.AppRunner:
    """Starts serving `app`; handler cancellation makes a client disconnect abort its request. The
    keep-alive timer also runs from accept to the first request, so it bounds a slow header too."""
    # Requests are drained before cleanup (see serve), so cleanup only closes idle connections.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                           keepalive_timeout=timeout_keep_alive)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG).start()
    return runner


def raise_open_files_limit() -> None:
    """Raises the soft limit on open files to the hard one: each client connection takes one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.debug("open_files_limit_raised", soft=soft, hard=hard)


async def serve(tokenizer: Tokenizer, args: argparse.Namespace) -> None:
    """Serves until SIGINT or SIGTERM; then drains (see Drain) and stops."""
    raise_open_files_limit()
    app = build_app(tokenizer, args.scheduler_address, args.served_model_name, api_key=args.api_key,
                    protect_metrics=args.protect_metrics, allowed_origins=args.allowed_origins,
                    stream_interval=args.stream_interval, max_client_batch_size=args.max_client_batch_size,
                    body_read_timeout=args.body_read_timeout)
    # The tokenizer and everything loaded so far live as long as the process: frozen, they leave
    # the collector's full passes, which a large request's objects would otherwise trigger over
    # the whole heap (tens of milliseconds with the event loop held).
    gc.freeze()
    runner = await start(app, args.host, args.port, args.timeout_keep_alive)
    log.info("gateway_listening", host=args.host, port=args.port, scheduler=args.scheduler_address,
             api_key_required=bool(args.api_key), allowed_origins=args.allowed_origins)
    await service.wait_for_signal()
    await app[GATEWAY].drain.drain(args.shutdown_timeout)
    await runner.cleanup()
    log.info("gateway_stopped")


def run(args: argparse.Namespace) -> None:
    """Blocks serving the gateway until SIGINT/SIGTERM; args.model is the model directory."""
    path = args.tokenizer or args.model
    if not path:
        raise SystemExit("gateway: pass the model directory or --tokenizer")
    aio.run(serve(Tokenizer.load(path), args))

