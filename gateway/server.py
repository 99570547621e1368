"""Gateway entry point: flags, startup and graceful shutdown."""
import argparse
import asyncio
import json
import os
import signal

from aiohttp import web

from pagedserve.gateway.app import build_app
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.common.log import configure, get_logger

log = get_logger(__name__)

# In-flight requests get this long to finish after SIGTERM before they are cancelled.
SHUTDOWN_TIMEOUT_S = 30.0


def _add_once(group: argparse._ArgumentGroup, flag: str, **kwargs) -> None:
    # The CLI may already have added a shared flag (--served-model-name via add_engine_args).
    try:
        group.add_argument(flag, **kwargs)
    except argparse.ArgumentError:
        pass


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    """Adds the gateway's flags; the model directory stays the caller's positional argument."""
    g = parser.add_argument_group("gateway")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--scheduler-address", default="127.0.0.1:50051",
                   help="the scheduler's Engine gRPC address: host:port or unix:///path")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory; defaults to the model directory")
    _add_once(g, "--served-model-name", default=None,
              help="the model name clients send; defaults to the scheduler's")
    _add_once(g, "--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_serving_args(g)


def add_serving_args(group: argparse._ActionsContainer) -> None:
    """API key, CORS and streaming flags, shared with `pagedserve serve`."""
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


def parse_origins(value: str) -> list[str]:
    """A JSON list (vLLM's form) or a comma-separated list."""
    if value.lstrip().startswith("["):
        return [str(o) for o in json.loads(value)]
    return [o.strip() for o in value.split(",") if o.strip()]


async def start(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Starts serving `app`; handler cancellation makes a client disconnect abort its request."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def serve(tokenizer: Tokenizer, args: argparse.Namespace) -> None:
    """Serves until SIGINT or SIGTERM, then stops accepting and drains in-flight requests."""
    app = build_app(tokenizer, args.scheduler_address, args.served_model_name, api_key=args.api_key,
                    protect_metrics=args.protect_metrics, allowed_origins=args.allowed_origins,
                    stream_interval=args.stream_interval)
    runner = await start(app, args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("gateway_listening", host=args.host, port=args.port, scheduler=args.scheduler_address,
             api_key_required=bool(args.api_key), allowed_origins=args.allowed_origins)
    await stop.wait()
    log.info("gateway_stopping")
    await runner.cleanup()
    log.info("gateway_stopped")


def run(args: argparse.Namespace) -> None:
    """Blocks serving the gateway until SIGINT/SIGTERM; args.model is the model directory."""
    path = args.tokenizer or args.model
    if not path:
        raise SystemExit("gateway: pass the model directory or --tokenizer")
    tokenizer = Tokenizer.from_dir(path)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(tokenizer, args))
    else:
        uvloop.run(serve(tokenizer, args))


def main() -> None:
    parser = argparse.ArgumentParser(description="pagedserve gateway: OpenAI REST in front of a scheduler")
    parser.add_argument("model", nargs="?", help="model directory (for the tokenizer)")
    add_gateway_args(parser)
    args = parser.parse_args()
    configure(args.log_level, service="gateway")
    run(args)


if __name__ == "__main__":
    main()
