"""The `pagedserve` command: serve the whole stack, run one service, benchmark."""
import argparse
import json
import os
import secrets
import socket
import sys

from pagedserve.common import aio, also_serve, arg_types, service
from pagedserve.common.also_serve import AlsoServe
from pagedserve.common.config import (COMPAT_FLAGS, EXECUTOR_FLAGS, GEOMETRY_FLAGS, SCHEDULER_FLAGS,
                                      EngineConfig, add_engine_args, add_geometry_checks,
                                      config_from_args, config_to_argv, flag_name, flags_given)
from pagedserve.common.generation_config import sampling_defaults
from pagedserve.common.log import configure, get_logger
from pagedserve.common.process import pass_start_gate
from pagedserve.common.model_shapes import SHAPES, write_shape
from pagedserve.entrypoints import default_model
from pagedserve.entrypoints.arg_parser import Parser

# Errors whose message says all a user needs; any other also names its type.
USER_ERRORS = (ValueError, OSError)
TLS_FLAGS = ("grpc_tls_cert", "grpc_tls_key", "grpc_tls_ca")
# The main model's flags that an --also-serve model takes unless it sets them: those of the machine
# and the engine's kind, not of the model (its name, context, memory share, runner, quantization).
INHERITED_FLAGS = ("device", "dtype", "kv_cache_dtype", "load_format", "seed", "enforce_eager", "block_size",
                   "async_scheduling", "disable_log_stats", "enable_prefix_caching")

log = get_logger(__name__)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(command=next(iter(argv), None)).parse_args(argv)
    configure(args.log_level, service=args.command, fmt=args.log_format)
    try:
        use_grpc_tls(args)
        return args.run(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.log_level == "debug":
            raise
        reason = (str(e) if isinstance(e, USER_ERRORS)
                  else f"{type(e).__name__}: {e} (--log-level debug shows where)")
        sys.stderr.write(f"pagedserve: error: {reason}\n")
        return 1


def build_parser(prog: str = "pagedserve", command: str | None = None) -> Parser:
    """Every subcommand's flags, or with `command` (the subcommand about to run) only its own: a
    service that `serve` starts then imports no other service's modules (the gateway's, which
    `serve`'s flags need, took 0.5-0.7 s of each executor's and scheduler's start on the 2-core
    machine)."""
    common = Parser(add_help=False)
    common.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="least severe log level shown; debug also shows tracebacks of errors")
    common.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="logs on stderr as readable lines, or one JSON object per line")
    grpc_security = Parser(add_help=False)
    add_grpc_tls_args(grpc_security)
    model = Parser(add_help=False)
    model.add_argument("model", nargs="?", default=None,
                       help=f"a Hugging Face model directory or a .gguf file; {default_model.NAME} if omitted")
    parser = Parser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, parents, help_text, add_args in [
            ("serve", [common, grpc_security], "run gateway, scheduler and executor", _serve_command),
            ("run-batch", [common, grpc_security],
             "run a file of OpenAI requests offline (vLLM's run_batch), like the Batch API", _run_batch_command),
            ("gateway", [common, model, grpc_security], "run the OpenAI REST gateway", _gateway_command),
            ("scheduler", [common, model, grpc_security], "run the gRPC scheduler", _scheduler_command),
            ("executor", [common, model, grpc_security], "run the GPU executor", _executor_command),
            ("probe", [common, grpc_security], "exit 0 if a service is healthy (compose)", _probe_command),
            ("bench", [common], "benchmarks", _bench_command),
            ("make-shape-model", [common], "write a config-only model of a named shape, for --load-format dummy",
             _shape_command)]:
        subparser = sub.add_parser(name, parents=parents, help=help_text)
        if command in (None, name):
            add_args(subparser)
    return parser


def _serve_command(serve: argparse.ArgumentParser) -> None:
    add_serve_args(serve)
    serve.set_defaults(run=run_serve)


def _run_batch_command(run_batch: argparse.ArgumentParser) -> None:
    from pagedserve.entrypoints.run_batch import add_run_batch_args
    add_run_batch_args(run_batch)
    add_serve_args(run_batch)
    # Its progress bar, rather than a line per poll of it.
    run_batch.set_defaults(run=run_run_batch, uvicorn_log_level="warning")


def _gateway_command(gateway: argparse.ArgumentParser) -> None:
    from pagedserve.gateway.server import add_gateway_args
    add_gateway_args(gateway)
    gateway.set_defaults(run=run_gateway)


def _scheduler_command(scheduler: argparse.ArgumentParser) -> None:
    from pagedserve.scheduler_svc.server import add_scheduler_args
    add_scheduler_args(scheduler)
    add_engine_args(scheduler, SCHEDULER_FLAGS)
    add_geometry_checks(scheduler)
    scheduler.set_defaults(run=run_scheduler)


def _executor_command(executor: argparse.ArgumentParser) -> None:
    executor.add_argument("--address", default="127.0.0.1:50052",
                          help="where the executor listens (host:port or unix:///path)")
    add_engine_args(executor, EXECUTOR_FLAGS + COMPAT_FLAGS)
    executor.set_defaults(run=run_executor)


def _probe_command(probe: argparse.ArgumentParser) -> None:
    target = probe.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", help="address of a gRPC service with the standard health service")
    target.add_argument("--http", help="URL that answers 200 when healthy")
    probe.set_defaults(run=run_probe)


def _bench_command(bench: argparse.ArgumentParser) -> None:
    from pagedserve.bench.cli import add_bench_args
    add_bench_args(bench)


def _shape_command(shape: argparse.ArgumentParser) -> None:
    shape.add_argument("name", choices=sorted(SHAPES), help="the shape")
    shape.add_argument("dir", help="where to write it")
    shape.add_argument("--with-tokenizer", action="store_true",
                       help="add a synthetic tokenizer, so that `serve` can run on it")
    shape.set_defaults(run=run_make_shape_model)


def add_grpc_tls_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grpc-tls-cert", default=None,
                        help="PEM certificate chain that this process presents on its gRPC connections, as "
                             "server and as client (needs --grpc-tls-key); without it, no TLS")
    parser.add_argument("--grpc-tls-key", default=None, help="the PEM private key of --grpc-tls-cert")
    parser.add_argument("--grpc-tls-ca", default=None,
                        help="PEM CA certificates that the other side's certificate must chain to; a server "
                             "given one requires a client certificate (mutual TLS)")


def use_grpc_tls(args: argparse.Namespace) -> None:
    """Makes this process's gRPC channels and servers use the --grpc-tls-* files, if given."""
    cert, key, ca = (getattr(args, name, None) for name in TLS_FLAGS)
    if (cert is None) != (key is None) or (ca is not None and cert is None):
        raise ValueError("--grpc-tls-cert and --grpc-tls-key go together, and --grpc-tls-ca needs both")
    if cert is not None:
        service.use_tls(service.Tls.load(cert, key, ca))


def grpc_tls_argv(args: argparse.Namespace) -> list[str]:
    """The --grpc-tls-* flags given, to pass on to a child."""
    return flags_given(args, TLS_FLAGS)


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """`serve`'s flags: vLLM's `vllm serve` and `python -m vllm.entrypoints.openai.api_server`."""
    serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                       help=f"a Hugging Face model directory or .gguf file; {default_model.NAME} "
                            "if neither this nor --model is given")
    serve.add_argument("--model", default=None, help="the same as MODEL, as vLLM's api_server takes it")
    serve.add_argument("--scheduler-address", default=None,
                       help="also expose the scheduler's gRPC Engine service here (e.g. 127.0.0.1:50051); "
                            "with --data-parallel-size N, N comma-separated addresses")
    serve.add_argument("--data-parallel-size", "-dp", type=arg_types.positive_int, default=1,
                       help="engines (executor + scheduler, each on its own GPU) behind the one gateway, "
                            "which sends each request to the least loaded and shared prefixes to one")
    serve.add_argument("--also-serve", type=also_serve_arg, action="append", default=[],
                       metavar="MODEL[,key=value...]",
                       help="start another model behind the same gateway (repeatable), e.g. an embedding "
                            "model or a reranker: requests go to the model their `model` names. Keys are "
                            "engine flags without dashes (served-model-name=A,B, gpu-memory-utilization=0.2, "
                            "max-model-len=512, ...) and tokenizer, chat-template (a file), generation-config; "
                            "device, dtype, load-format, seed, block-size and the like follow the main "
                            "model's. Its engine shares the main engine's GPU(s): --gpu-memory-utilization "
                            "plus every gpu-memory-utilization here must be at most 1")
    serve.add_argument("--config", metavar="FILE",
                       help="read flags from a YAML file of long flag names and values, as vLLM does "
                            "(`max-model-len: 8k`); flags on the command line win over the file's")
    serve.add_argument("--startup-timeout", type=float, default=900.0,
                       help="seconds each process may take to become ready")
    from pagedserve.gateway.server import add_serving_args
    add_serving_args(serve)
    add_engine_args(serve)


def _model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if getattr(args, "served_model_name", None) is None:
        args.served_model_name = [default_model.NAME]
    return str(default_model.default_model())


def run_run_batch(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints import run_batch
    return run_batch.run(args, run_serve)


def run_serve(args: argparse.Namespace, listener: socket.socket | None = None) -> int:
    """Serves until a signal; on `listener` when given (bound already), else on --host and --port."""
    if args.model and args.model_path and args.model != args.model_path:
        raise ValueError(f"two models given, {args.model_path} and --model {args.model}: pass one")
    args.model = args.model or args.model_path
    args.model = _model_dir(args)
    scheduler_addresses = _scheduler_addresses(args)
    config = config_from_args(args)
    share_grpc_token(scheduler_addresses)
    # Every child's: logging, and gRPC TLS.
    shared = ["--log-level", args.log_level, "--log-format", args.log_format, *grpc_tls_argv(args)]
    from pagedserve.entrypoints.launcher import Launcher, serve, start_executors
    launcher = Launcher(args.shutdown_timeout)
    engines = start_executors(launcher, args.model, config_to_argv(config, EXECUTOR_FLAGS) + shared,
                              args.data_parallel_size, config.tensor_parallel_size)
    try:
        also, listener = _check_serve(args, config, listener)
        from pagedserve.gateway import tls
        https = tls.server_context(args) is not None
        from pagedserve.gateway.server import api_key
        # The gateway gets the key in its environment: in its argv the key would show in process listings.
        key = api_key(args)
        argv = {"scheduler": config_to_argv(config, SCHEDULER_FLAGS) + shared,
                "gateway": _gateway_argv(args, config) + shared}
        also_engines = [also_engine(extra, shared) for extra in also]
    except BaseException:
        launcher.stop()
        raise
    return serve(launcher, engines, args.model, argv, listener, scheduler_addresses, args.startup_timeout, key,
                 also_engines, https)


def _check_serve(args: argparse.Namespace, config: EngineConfig,
                 listener: socket.socket | None) -> tuple[list[argparse.Namespace], socket.socket]:
    """What `serve` checks while its executors import their modules: the model, its generation
    config, each --also-serve engine, and the gateway's port, which it binds unless given
    `listener`; returns the --also-serve engines' arguments and the gateway's socket."""
    from pagedserve.entrypoints import preflight
    preflight.check_model(args.model, args.max_model_len)
    sampling_defaults(args.model, args.generation_config, args.override_generation_config)
    also = [also_serve_args(spec, args) for spec in args.also_serve]
    for extra in also:
        preflight.check_model(extra.model, extra.max_model_len)
    check_memory_shares(config, [config_from_args(extra) for extra in also])
    from pagedserve.gateway import uds
    return also, listener or (uds.bind_unix(args.uds) if args.uds else preflight.bind(args.host, args.port))


def also_serve_arg(value: str) -> AlsoServe:
    """--also-serve, checked when parsed."""
    try:
        return also_serve.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def also_serve_args(spec: AlsoServe, main: argparse.Namespace) -> argparse.Namespace:
    """One --also-serve model's flags: its own keys, else the main model's INHERITED_FLAGS, else the
    defaults. Exits with a one-line error on an unknown key or a bad value."""
    parser = Parser(prog=f"pagedserve serve --also-serve {spec.model}", add_help=False)
    add_engine_args(parser)
    # The gateway's flags for this model, passed on to it as they are.
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--chat-template", type=template_file, default=None)
    parser.add_argument("--generation-config", default="auto")
    inherited = {name: getattr(main, name) for name in INHERITED_FLAGS}
    args = parser.parse_args(spec.argv(), argparse.Namespace(**inherited))
    args.model = spec.model
    return args


def template_file(value: str) -> str:
    """An --also-serve chat-template, checked here and passed on as given (its gateway reads it)."""
    from pagedserve.gateway.server import chat_template
    chat_template(value)
    return value


def check_memory_shares(main: EngineConfig, also: list[EngineConfig]) -> None:
    """Raises ValueError when the engines sharing a GPU ask for more than all of its memory."""
    shares = [main.gpu_memory_utilization, *(c.gpu_memory_utilization for c in also)]
    # Rounded: 0.6 + 0.3 + 0.1 adds up to a hair above 1 in floating point.
    if not also or main.device == "cpu" or round(sum(shares), 6) <= 1:
        return
    raise ValueError(f"the engines sharing the GPU ask for {' + '.join(f'{s:g}' for s in shares)} = "
                     f"{sum(shares):.2f} of its memory, more than 1: lower --gpu-memory-utilization and give "
                     "each --also-serve its share, e.g. --gpu-memory-utilization 0.6 --also-serve "
                     "MODEL,gpu-memory-utilization=0.3")


def also_engine(args: argparse.Namespace, shared: list[str]) -> "AlsoEngine":
    """What the launcher starts for an --also-serve model (`args`: its also_serve_args), and what its
    gateway is told of it."""
    from pagedserve.entrypoints.launcher import AlsoEngine
    config = config_from_args(args)
    gateway = {"served-model-name": ",".join(config.served_model_name or [config.name]),
               "generation-config": args.generation_config}
    for key in ("tokenizer", "chat_template"):
        if getattr(args, key):
            gateway[key.replace("_", "-")] = getattr(args, key)
    return AlsoEngine(args.model, {"executor": config_to_argv(config, EXECUTOR_FLAGS) + shared,
                                   "scheduler": config_to_argv(config, SCHEDULER_FLAGS) + shared}, gateway)


def share_grpc_token(scheduler_addresses: list[str] | None) -> None:
    """Gives the children a gRPC token through the environment: PAGEDSERVE_GRPC_TOKEN if set, else
    a random one. Their sockets sit in a private folder already; the token is the second lock."""
    if service.token() is not None:
        return
    os.environ[service.TOKEN_ENV] = secrets.token_urlsafe(32)
    if scheduler_addresses:
        log.warning("grpc_token_generated", scheduler_addresses=scheduler_addresses,
                    message=f"set {service.TOKEN_ENV} to call the Engine service at --scheduler-address: "
                            "serve made a random token that no one else knows")


def _scheduler_addresses(args: argparse.Namespace) -> list[str] | None:
    if args.scheduler_address is None:
        return None
    from pagedserve.gateway.engine_pool import split_addresses
    addresses = split_addresses(args.scheduler_address)
    if len(addresses) != args.data_parallel_size:
        raise ValueError(f"--scheduler-address lists {len(addresses)} addresses for --data-parallel-size "
                         f"{args.data_parallel_size}; list one per engine")
    return addresses


def _gateway_argv(args: argparse.Namespace, config: EngineConfig) -> list[str]:
    from pagedserve.gateway import tls
    from pagedserve.gateway.server import tool_parser
    argv = ["--served-model-name", *(config.served_model_name or [config.name]),
            "--uvicorn-log-level", args.uvicorn_log_level, *tls.argv(args)]
    if args.protect_metrics:
        argv.append("--protect-metrics")
    for name, default in (("allowed_origins", []), ("allowed_methods", ["*"]), ("allowed_headers", ["*"])):
        if getattr(args, name) != default:
            argv += [flag_name(name), json.dumps(getattr(args, name))]
    if args.allow_credentials:
        argv.append("--allow-credentials")
    if args.allowed_hosts:
        argv += ["--allowed-hosts", json.dumps(args.allowed_hosts)]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    if args.generation_config != "auto":
        argv += ["--generation-config", args.generation_config]
    if args.override_generation_config:
        argv += ["--override-generation-config", json.dumps(args.override_generation_config)]
    if args.stream_interval != 1:
        argv += ["--stream-interval", str(args.stream_interval)]
    for name in ("shutdown_timeout", "max_client_batch_size", "timeout_keep_alive", "body_read_timeout",
                 "responses_store_mb", "responses_store_ttl", "batch_concurrency", "batch_max_file_mb"):
        argv += [flag_name(name), str(getattr(args, name))]
    if args.batch_dir is not None:
        argv += ["--batch-dir", str(args.batch_dir)]
    if args.max_concurrent_requests is not None:
        argv += ["--max-concurrent-requests", str(args.max_concurrent_requests)]
    if args.chat_template is not None:
        argv.append(f"--chat-template={args.chat_template}")
    if args.enable_log_requests:
        argv.append("--enable-log-requests")
    if args.enable_log_outputs:
        argv.append("--enable-log-outputs")
    if args.max_log_len is not None:
        argv += ["--max-log-len", str(args.max_log_len)]
    if args.disable_uvicorn_access_log:
        argv.append("--disable-uvicorn-access-log")
    if args.trust_request_chat_template:
        argv.append("--trust-request-chat-template")
    if args.enable_prompt_tokens_details:
        argv.append("--enable-prompt-tokens-details")
    if args.enable_force_include_usage:
        argv.append("--enable-force-include-usage")
    if args.return_tokens_as_token_ids:
        argv.append("--return-tokens-as-token-ids")
    if args.chat_template_content_format != "auto":
        argv += ["--chat-template-content-format", args.chat_template_content_format]
    if args.response_role != "assistant":
        argv.append(f"--response-role={args.response_role}")
    if tool_parser(args):
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser:
        argv += ["--reasoning-parser", args.reasoning_parser]
    return argv


def run_gateway(args: argparse.Namespace) -> None:
    from pagedserve.gateway.server import run
    args.model = _model_dir(args)
    run(args)


def run_scheduler(args: argparse.Namespace) -> None:
    from pagedserve.scheduler_svc.server import serve
    args.model = args.model or default_model.NAME
    expected = {name: getattr(args, name) for name in GEOMETRY_FLAGS if getattr(args, name) is not None}
    aio.run(serve(config_from_args(args), args.address, args.executor_address, expected))


def run_executor(args: argparse.Namespace) -> None:
    from pagedserve.executor_svc.server import serve
    pass_start_gate()
    args.model = _model_dir(args)
    aio.run(serve(config_from_args(args), args.address))


def run_probe(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.launcher import grpc_ready, http_ready
    probe = grpc_ready(args.grpc) if args.grpc else http_ready(args.http)
    return 0 if probe() else 1


def run_make_shape_model(args: argparse.Namespace) -> None:
    print(write_shape(args.name, args.dir, tokenizer=args.with_tokenizer))


if __name__ == "__main__":
    sys.exit(main())
