"""Gateway entry point: flags, startup and graceful shutdown."""
import argparse
import gc
import json
import logging
import os
import socket
import resource
import ssl
from pathlib import Path

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from pagedserve.common import aio, also_serve, arg_types, service
from pagedserve.common.also_serve import AlsoServe
from pagedserve.common.chat_template import CONTENT_FORMATS
from pagedserve.common.config import add_engine_args
from pagedserve.common.generation_config import max_tokens_cap, sampling_defaults
from pagedserve.gateway import reasoning, tls, tool_parsers, uds
from pagedserve.gateway.app import build_app
from pagedserve.gateway.cors import CorsRules
from pagedserve.gateway.batch_runner import DEFAULT_CONCURRENCY, DEFAULT_MAX_FILE_MB
from pagedserve.gateway.batch_store import default_batch_dir
from pagedserve.gateway.engine_pool import EnginePool, split_addresses
from pagedserve.gateway.hosts import allowed_hosts, is_loopback
from pagedserve.gateway.response_store import DEFAULT_STORE_MB, DEFAULT_STORE_TTL_S
from pagedserve.common.tokenizer import Tokenizer, read_chat_template
from pagedserve.gateway.state import DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_MAX_CLIENT_BATCH_SIZE, GATEWAY, ModelEngines
from pagedserve.common.log import get_logger
from pagedserve.common.process import pass_start_gate

log = get_logger(__name__)
# vLLM's --uvicorn-log-level names, as logging levels of the HTTP server's own logs.
HTTP_LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
                   "info": logging.INFO, "debug": logging.DEBUG, "trace": logging.DEBUG}

# In-flight requests get this long to finish after SIGTERM before they end with an error.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
# vLLM's (uvicorn's) keep-alive default.
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0
# A burst of connections waits in the kernel's queue rather than being reset (the default is 128).
LISTEN_BACKLOG = 2048
# What an --also-serve model tells a gateway.
ALSO_SERVE_KEYS = frozenset({"scheduler-address", "served-model-name", "tokenizer", "chat-template",
                             "generation-config"})


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    """Adds the gateway's flags; the model directory stays the caller's positional argument."""
    g = parser.add_argument_group("gateway")
    g.add_argument("--scheduler-address", type=scheduler_addresses, default="127.0.0.1:50051",
                   help="the scheduler's Engine gRPC address (host:port or unix:///path), or several "
                        "comma-separated: each request goes to the least loaded one that serves, requests "
                        "sharing a prompt prefix to the same one")
    g.add_argument("--listen-fd", type=int, default=None,
                   help="serve on this inherited, bound socket instead of binding --host/--port "
                        "(`pagedserve serve` binds the port before loading the model)")
    g.add_argument("--also-serve", type=also_serve_spec, action="append", default=[],
                   metavar="MODEL,scheduler-address=A[,B...][,key=value...]",
                   help="another model to route to (repeatable): a request goes to the model its `model` "
                        "names. Keys: scheduler-address (its schedulers, required), served-model-name "
                        "(names clients may send, comma-separated; default the scheduler's), tokenizer, "
                        "chat-template (a file), generation-config (as the flags of the same names; default "
                        "the model's)")
    # The scheduler reports its served name; the gateway's flag, when given, overrides it.
    add_engine_args(parser, ("served_model_name", "max_log_len"))
    add_serving_args(g)


def add_serving_args(group: argparse._ActionsContainer) -> None:
    """Listening, API key, CORS and streaming flags, shared with `pagedserve serve`."""
    group.add_argument("--tokenizer", default=None,
                       help="a Hugging Face tokenizer directory (or .gguf file) instead of the model's")
    group.add_argument("--generation-config", default="auto",
                       help="where default sampling options come from: auto (the model's "
                            "generation_config.json), vllm (none: vLLM's defaults), or a folder")
    group.add_argument("--override-generation-config", type=arg_types.json_object, default=None,
                       help="JSON of default sampling options over the generation config's, e.g. "
                            "'{\"temperature\": 0.6, \"top_p\": 0.95}' (temperature, top_p, top_k, min_p, "
                            "repetition_penalty); a request's own values win")
    group.add_argument("--host", default="127.0.0.1",
                       help="where the REST API listens; 0.0.0.0 for every interface (set --api-key then)")
    group.add_argument("--port", type=arg_types.port, default=8000, help="the REST API's TCP port")
    group.add_argument("--uds", default=None, metavar="PATH",
                       help="serve the REST API on this Unix domain socket instead; --host and --port "
                            "are then ignored")
    group.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every route but /health (and "
                            "/metrics); defaults to $PAGEDSERVE_API_KEY, which, unlike a flag, process "
                            "listings do not show")
    group.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API key from this file (a Docker or Kubernetes secret); surrounding "
                            "whitespace, such as a final newline, is dropped")
    group.add_argument("--protect-metrics", action="store_true", help="require the API key on /metrics too")
    tls.add_tls_args(group)
    group.add_argument("--allowed-origins", type=parse_list, default=[],
                       help="CORS: origins browsers may call the API from, comma-separated or a JSON list; "
                            "* allows any")
    group.add_argument("--allowed-methods", type=parse_list, default=["*"],
                       help="CORS: methods browsers may use, comma-separated or a JSON list; * allows every "
                            "method a route takes")
    group.add_argument("--allowed-headers", type=parse_list, default=["*"],
                       help="CORS: request headers browsers may send, comma-separated or a JSON list; * allows "
                            "any")
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: let browsers send cookies and HTTP authentication (the origin is echoed "
                            "then, never *)")
    group.add_argument("--allowed-hosts", type=parse_list, default=[],
                       help="Host header names answered besides localhost, 127.0.0.1 and [::1] when "
                            "listening on a loopback address (others get 421, against DNS rebinding); "
                            "elsewhere the only names answered, if given; * answers any")
    group.add_argument("--stream-interval", type=arg_types.positive_int, default=1,
                       help="tokens per streamed chunk; more means fewer writes under load (vLLM's flag)")
    group.add_argument("--chat-template", type=chat_template, default=None,
                       help="a Jinja chat template, as a file or inline, used instead of the model's")
    group.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                       help="how a message's content reaches the chat template: one string (its text parts "
                            "joined by newlines), a list of OpenAI's text parts, or auto: parts where the "
                            "template loops over a message's content")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a `chat_template` in requests (vLLM's flag): each renders in a child "
                            "process, within 2 s and 1 GiB; without it such requests get a 400")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request when it ends: id, prompt tokens, sampling parameters, "
                            "finish reasons, completion tokens and latency")
    group.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                       default=False, help="no line per request (the default; vLLM's older flag)")
    group.add_argument("--enable-log-outputs", action="store_true",
                       help="with --enable-log-requests, each request's line holds its outputs' text (cut to "
                            "--max-log-len characters)")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens, which tells a client whether "
                            "anyone sent the same prompt prefix lately")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="accepted for vLLM's commands: every response carries X-Request-Id anyway (the "
                            "client's, or a new one)")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="accepted for vLLM's commands: GET /load reports the requests in flight anyway")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="end every chat and completions stream with a usage chunk, as "
                            "stream_options.include_usage does (vLLM's flag)")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name each token \"token_id:N\", as a request's "
                            "return_tokens_as_token_ids does (one that sets it false gets texts)")
    group.add_argument("--response-role", default="assistant", type=arg_types.name,
                       help="the role chat replies are written as where the request asks for a new turn "
                            "(add_generation_prompt, the default); else the final message's role")
    group.add_argument("--uvicorn-log-level", choices=list(HTTP_LOG_LEVELS), default="info",
                       help="level of the HTTP server's own logs (vLLM's uvicorn, aiohttp here): "
                            "info logs one access line per HTTP request, warning and above none")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no access line per HTTP request, whatever --uvicorn-log-level says (vLLM's flag)")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="accepted for vLLM's commands: this server has no /docs, /redoc or /openapi.json")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide when to call tools (tool_choice "auto"); needs '
                            "--tool-call-parser")
    group.add_argument("--tool-call-parser", choices=tool_parsers.PARSERS, default=None,
                       help="the model's tool-call format: hermes (Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.1), "
                            "pythonic / llama4_pythonic (Llama 3.2, Llama 4), mistral, phi4_mini_json, "
                            "qwen3_coder / qwen3_xml (Qwen3-Coder)")
    group.add_argument("--reasoning-parser", choices=reasoning.PARSERS, default=None,
                       help="return a reasoning model's <think> text (mistral: [THINK]) as `reasoning` / "
                            "`reasoning_content`")
    group.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                       help="seconds running requests get to finish after SIGTERM/SIGINT; then streams end "
                            "with an error event and `data: [DONE]`, other requests with a 503")
    group.add_argument("--max-concurrent-requests", type=arg_types.positive_int, default=None,
                       help="most model requests (completions, chat, embeddings, rerank, score) this gateway "
                            "serves at once (TGI's flag); more get 503 server_overloaded with Retry-After "
                            "(default: no limit here, the schedulers' --max-num-queued-reqs bounds the wait)")
    group.add_argument("--max-client-batch-size", type=int, default=DEFAULT_MAX_CLIENT_BATCH_SIZE,
                       help="most completions one request may ask for (prompts x n), embedding inputs, rerank "
                            "documents or score pairs; more is a 400")
    group.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                       help="seconds a connection may stay idle, or take to send a request's headers, "
                            "before it is closed")
    group.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT_S,
                       help="seconds a request body may take to arrive; slower ones get a 408")
    group.add_argument("--responses-store-mb", type=int, default=DEFAULT_STORE_MB,
                       help="MiB of memory for stored /v1/responses responses (`store: true`, for "
                            "previous_response_id and GET); past it the oldest go first; 0 stores none")
    group.add_argument("--responses-store-ttl", type=float, default=DEFAULT_STORE_TTL_S,
                       help="seconds a stored /v1/responses response is kept")
    group.add_argument("--batch-dir", type=Path, default=None,
                       help="where the Files and Batch APIs keep their files and SQLite database, which a "
                            "restarted server resumes its batches from (default "
                            "$XDG_DATA_HOME/pagedserve/batches, else ~/.local/share/pagedserve/batches)")
    group.add_argument("--batch-concurrency", type=arg_types.positive_int, default=DEFAULT_CONCURRENCY,
                       help="batch lines (Batch API requests) running at once, as background requests that "
                            "the schedulers run on the capacity interactive requests leave")
    group.add_argument("--batch-max-file-mb", type=arg_types.positive_int, default=DEFAULT_MAX_FILE_MB,
                       help="largest file POST /v1/files takes, in MiB (OpenAI's limit: 200)")


def api_key(args: argparse.Namespace) -> str | None:
    """The API key of --api-key, else --api-key-file, else $PAGEDSERVE_API_KEY (empty: none), with
    surrounding whitespace dropped; raises ValueError for a key given twice, empty or holding a space."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("--api-key and --api-key-file both give the API key; pass one")
    key, source = args.api_key, "--api-key"
    if args.api_key_file is not None:
        key, source = Path(args.api_key_file).read_text(), f"the file {args.api_key_file}"
    if key is None:
        key, source = os.environ.get("PAGEDSERVE_API_KEY") or None, "PAGEDSERVE_API_KEY"
    if key is None:
        return None
    key = key.strip()
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"the API key in {source} is empty or holds whitespace; a key is one word "
                         "(clients send it as `Authorization: Bearer KEY`)")
    return key


def tool_parser(args: argparse.Namespace) -> str | None:
    """The parser for tool_choice "auto", None when it is off; exits on a half-given pair."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def scheduler_addresses(value: str) -> str:
    """--scheduler-address, checked when parsed."""
    try:
        split_addresses(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def also_serve_spec(value: str) -> AlsoServe:
    """--also-serve, checked when parsed."""
    try:
        spec = also_serve.parse(value)
        _check_also_serve(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if "chat-template" in spec.options:
        chat_template(spec.options["chat-template"])
    return spec


def _check_also_serve(spec: AlsoServe) -> None:
    unknown = sorted(set(spec.options) - ALSO_SERVE_KEYS)
    if unknown:
        raise ValueError(f"--also-serve {spec.model}: unknown key {unknown[0]}; a gateway takes "
                         f"{', '.join(sorted(ALSO_SERVE_KEYS))}")
    if "scheduler-address" not in spec.options:
        raise ValueError(f"--also-serve {spec.model}: give its schedulers as scheduler-address=A[,B...]")
    split_addresses(spec.options["scheduler-address"])


def also_served(spec: AlsoServe) -> ModelEngines:
    """The engines, tokenizer, names and sampling defaults of one --also-serve model."""
    options = spec.options
    names = options["served-model-name"].split(",") if "served-model-name" in options else []
    template = chat_template(options["chat-template"]) if "chat-template" in options else None
    source = options.get("generation-config", "auto")
    defaults = sampling_defaults(spec.model, source)
    return ModelEngines(EnginePool(options["scheduler-address"]),
                        Tokenizer.load(options.get("tokenizer", spec.model), template), names,
                        defaults, max_tokens_cap(defaults, source))


def chat_template(value: str) -> str:
    """--chat-template's text, from the file it names or as given; checked when parsed."""
    try:
        return read_chat_template(value)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cors_rules(args: argparse.Namespace) -> CorsRules:
    return CorsRules(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


def parse_list(value: str) -> list[str]:
    """A JSON list (vLLM's form) or a comma-separated list."""
    if value.lstrip().startswith("["):
        return [str(o) for o in json.loads(value)]
    return [o.strip() for o in value.split(",") if o.strip()]


class AccessLogger(AbstractAccessLogger):
    """One structured line per HTTP request, as uvicorn writes at --uvicorn-log-level info."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        log.info("http_request", method=request.method, path=request.path, status=response.status,
                 remote=request.remote, elapsed_ms=round(time * 1000, 1))

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


async def start(app: web.Application, host: str, port: int, sock: socket.socket | None = None,
                timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                ssl_context: ssl.SSLContext | None = None) -> web.AppRunner:
    """Starts serving `app` on `sock`, else on host:port, over HTTPS with `ssl_context`; handler
    cancellation makes a client disconnect abort its request. The keep-alive timer also runs from
    accept to the first request, so it bounds a slow header too."""
    # Requests are drained before cleanup (see serve), so cleanup only closes idle connections.
    runner = web.AppRunner(app, handler_cancellation=True, access_log_class=AccessLogger,
                           access_log=logging.getLogger("aiohttp.access"), shutdown_timeout=1.0,
                           keepalive_timeout=timeout_keep_alive)
    await runner.setup()
    site = (web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG, ssl_context=ssl_context) if sock is None
            else web.SockSite(runner, sock, backlog=LISTEN_BACKLOG, ssl_context=ssl_context))
    await site.start()
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
    defaults = sampling_defaults(args.model, args.generation_config, args.override_generation_config)
    app = build_app(tokenizer, args.scheduler_address, args.served_model_name, api_key=args.api_key,
                    allowed_hosts=allowed_hosts(None if args.uds else args.host, args.allowed_hosts),
                    protect_metrics=args.protect_metrics, cors=cors_rules(args),
                    stream_interval=args.stream_interval, log_requests=args.enable_log_requests,
                    log_outputs=args.enable_log_outputs, max_log_len=args.max_log_len,
                    sampling_defaults=defaults,
                    max_tokens_cap=max_tokens_cap(defaults, args.generation_config, args.override_generation_config),
                    tool_parser=tool_parser(args), reasoning_parser=args.reasoning_parser,
                    max_client_batch_size=args.max_client_batch_size, body_read_timeout=args.body_read_timeout,
                    trust_request_chat_template=args.trust_request_chat_template,
                    max_concurrent_requests=args.max_concurrent_requests,
                    prompt_tokens_details=args.enable_prompt_tokens_details,
                    force_include_usage=args.enable_force_include_usage,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids, response_role=args.response_role,
                    content_format=args.chat_template_content_format, responses_store_mb=args.responses_store_mb, responses_store_ttl=args.responses_store_ttl,
                    also_serve=[also_served(spec) for spec in args.also_serve],
                    batch_dir=args.batch_dir or default_batch_dir(), batch_concurrency=args.batch_concurrency,
                    batch_max_file_mb=args.batch_max_file_mb)
    # The tokenizer and everything loaded so far live as long as the process: frozen, they leave
    # the collector's full passes, which a large request's objects would otherwise trigger over
    # the whole heap (tens of milliseconds with the event loop held).
    gc.freeze()
    # A socket `pagedserve serve` bound, else the gateway's own --uds one, else --host and --port.
    bound_here = args.listen_fd is None and args.uds is not None
    sock = socket.socket(fileno=args.listen_fd) if args.listen_fd is not None else (
        uds.bind_unix(args.uds) if bound_here else None)
    context = tls.server_context(args)
    # Under `pagedserve serve`, waits here until every scheduler serves. It blocks the event loop,
    # which runs nothing yet: the engine pool starts with the app.
    pass_start_gate()
    runner = await start(app, args.host, args.port, sock, args.timeout_keep_alive, context)
    where = {"uds": args.uds} if args.uds else {"host": args.host, "port": args.port}
    log.info("gateway_listening", **where, https=context is not None,
             scheduler=args.scheduler_address,
             also_serve=[spec.model for spec in args.also_serve],
             api_key_required=bool(args.api_key), allowed_origins=args.allowed_origins,
             chat_template_content_format=tokenizer.content_format(given=args.chat_template_content_format))
    if not args.api_key and not args.uds and not is_loopback(args.host):
        # Said on every start: vLLM's images listen on 0.0.0.0 without a key, and so may ours.
        log.warning("unauthenticated_public_bind", host=args.host, port=args.port,
                    message=f"anyone who can reach {args.host}:{args.port} can use this API: set an API key "
                            "with --api-key-file (or --api-key, PAGEDSERVE_API_KEY), or listen on 127.0.0.1")
    try:
        await service.wait_for_signal()
        await app[GATEWAY].drain.drain(args.shutdown_timeout)
        await runner.cleanup()
    finally:
        if bound_here:
            uds.remove(args.uds)
    log.info("gateway_stopped")


def run(args: argparse.Namespace) -> None:
    """Blocks serving the gateway until SIGINT/SIGTERM; args.model is the model directory."""
    path = args.tokenizer or args.model
    if not path:
        raise SystemExit("gateway: pass the model directory or --tokenizer")
    args.api_key = api_key(args)
    logging.getLogger("aiohttp").setLevel(HTTP_LOG_LEVELS[args.uvicorn_log_level])
    if args.disable_uvicorn_access_log:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    aio.run(serve(Tokenizer.load(path, args.chat_template), args))

