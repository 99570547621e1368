"""Gateway entry point: flags, startup and graceful shutdown."""
import argparse
import json
import os

from aiohttp import web

from pagedserve.common import aio, service
from pagedserve.common.config import add_engine_args
from pagedserve.gateway import reasoning, tool_parsers
from pagedserve.gateway.app import build_app
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.common.log import get_logger

log = get_logger(__name__)

# In-flight requests get this long to finish after SIGTERM before they are cancelled.
SHUTDOWN_TIMEOUT_S = 30.0


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
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide when to call tools (tool_choice "auto"); needs '
                            "--tool-call-parser")
    group.add_argument("--tool-call-parser", choices=tool_parsers.PARSERS, default=None,
                       help="the model's tool-call format: hermes (Qwen2.5, Qwen3, Hermes) or llama3_json")
    group.add_argument("--reasoning-parser", choices=reasoning.PARSERS, default=None,
                       help="return a reasoning model's <think> text as `reasoning` / `reasoning_content`")


def tool_parser(args: argparse.Namespace) -> str | None:
    """The parser for tool_choice "auto", None when it is off; exits on a half-given pair."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


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
                    stream_interval=args.stream_interval, tool_parser=tool_parser(args),
                    reasoning_parser=args.reasoning_parser)
    runner = await start(app, args.host, args.port)
    log.info("gateway_listening", host=args.host, port=args.port, scheduler=args.scheduler_address,
             api_key_required=bool(args.api_key), allowed_origins=args.allowed_origins)
    await service.wait_for_signal()
    log.info("gateway_stopping")
    await runner.cleanup()
    log.info("gateway_stopped")


def run(args: argparse.Namespace) -> None:
    """Blocks serving the gateway until SIGINT/SIGTERM; args.model is the model directory."""
    path = args.tokenizer or args.model
    if not path:
        raise SystemExit("gateway: pass the model directory or --tokenizer")
    aio.run(serve(Tokenizer.load(path), args))

