"""The aiohttp application: routes and middlewares."""
import asyncio
from pathlib import Path

from aiohttp import web

from pagedserve.gateway import (anthropic_api, batches_api, files_api, ollama_api, ops_routes, pooling_routes,
                               responses_api, routes, sagemaker, tokenize_routes)
from pagedserve.gateway.auth import auth_middleware
from pagedserve.gateway.batch_runner import BATCHES, DEFAULT_CONCURRENCY, DEFAULT_MAX_FILE_MB, BatchRunner
from pagedserve.gateway.batch_store import BatchStore
from pagedserve.gateway.cors import CORS, CorsRules
from pagedserve.gateway.engine_pool import EnginePool
from pagedserve.gateway.errors import MAX_BODY_BYTES, error_middleware
from pagedserve.gateway.generation import RequestLog
from pagedserve.gateway.hosts import host_middleware
from pagedserve.gateway.http_metrics import requests_middleware
from pagedserve.gateway.request_id import request_id_middleware
from pagedserve.gateway.response_store import DEFAULT_STORE_MB, DEFAULT_STORE_TTL_S, ResponseStore
from pagedserve.gateway.state import (DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_MAX_CLIENT_BATCH_SIZE, GATEWAY, Gateway,
                                      ModelEngines)
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.common.version import __version__

SERVER = f"pagedserve/{__version__}"


async def _startup(app: web.Application) -> None:
    gateway = app[GATEWAY]
    for model in gateway.models:
        model.engines.start()
    if gateway.trust_request_chat_template:
        gateway.templates.start()
    if BATCHES in app:
        await app[BATCHES].start()


async def _cleanup(app: web.Application) -> None:
    gateway = app[GATEWAY]
    if BATCHES in app:
        await app[BATCHES].stop()
    await gateway.responses.stop()
    await asyncio.gather(*(model.engines.close() for model in gateway.models))
    await gateway.templates.close()
    gateway.pool.shutdown(wait=False, cancel_futures=True)


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    # How `pagedserve serve` tells another pagedserve on its port from any other server.
    response.headers["Server"] = SERVER


def _check_names(models: list[set[str]]) -> None:
    """Raises ValueError when two models are given one name: a request could not tell them apart."""
    names = [name for model in models for name in model]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise ValueError(f"the served model name {twice!r} is given twice; give each model its own names "
                         "(--served-model-name, served-model-name= in --also-serve)")


def build_app(tokenizer: Tokenizer, scheduler_address: str, served_model_names: list[str] | None = None, *,
              api_key: str | None = None, protect_metrics: bool = False,
              allowed_hosts: frozenset[str] | None = None,
              cors: CorsRules | None = None, stream_interval: int = 1,
              log_requests: bool = False, log_outputs: bool = False, max_log_len: int | None = None,
              sampling_defaults: dict | None = None,
              max_tokens_cap: int | None = None,
              tool_parser: str | None = None, reasoning_parser: str | None = None,
              max_client_batch_size: int = DEFAULT_MAX_CLIENT_BATCH_SIZE,
              body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT_S,
              trust_request_chat_template: bool = False,
              max_concurrent_requests: int | None = None,
              prompt_tokens_details: bool = False, force_include_usage: bool = False,
              return_tokens_as_token_ids: bool = False, response_role: str = "assistant",
              content_format: str = "auto", responses_store_mb: int = DEFAULT_STORE_MB,
              responses_store_ttl: float = DEFAULT_STORE_TTL_S,
              also_serve: list[ModelEngines] | None = None, batch_dir: Path | None = None,
              batch_concurrency: int = DEFAULT_CONCURRENCY,
              batch_max_file_mb: int = DEFAULT_MAX_FILE_MB) -> web.Application:
    """The gateway app; serve it with handler_cancellation=True (see gateway.server.start).

    `scheduler_address` is one scheduler's address or several, comma-separated: each prompt goes
    to one of those in rotation (see engine_pool). They serve the main model, whose `tokenizer`,
    `served_model_names` and `sampling_defaults` these are; `also_serve` adds other models, each
    with its own (see Gateway.served_for for how a request finds its model).

    With `api_key`, every route but /health, /ping (and /metrics unless `protect_metrics`) needs it.
    With `allowed_hosts` (see hosts.allowed_hosts), other Host headers get a 421. `cors` lets browsers
    of its origins call the API.
    `log_requests` logs one line per finished request (vLLM's --enable-log-requests), with its outputs
    where `log_outputs` (--enable-log-outputs), each cut to `max_log_len` characters (None: whole).
    `sampling_defaults` (the model's generation config) fill the sampling options a request omits;
    no request gets more than `max_tokens_cap` output tokens.
    `tool_parser` reads tool calls under tool_choice "auto"; `reasoning_parser` splits off thinking.
    `trust_request_chat_template` lets requests bring a chat template (else a 400).
    Past `max_concurrent_requests` generation requests in flight, new ones get a 503.
    `prompt_tokens_details` puts cached_tokens in usage (vLLM's --enable-prompt-tokens-details).
    `force_include_usage` ends every stream with its usage (vLLM's --enable-force-include-usage).
    `return_tokens_as_token_ids` names logprobs' tokens "token_id:N" unless a request says otherwise.
    Chat replies that open a new turn are written as `response_role` (vLLM's --response-role).
    `content_format` is how messages' content reaches chat templates (--chat-template-content-format).
    Stored /v1/responses responses take up to `responses_store_mb` MiB and `responses_store_ttl` seconds.
    With `batch_dir`, the Files and Batch APIs keep their state there and run up to `batch_concurrency`
    batch lines at once, taking files up to `batch_max_file_mb` MiB.
    """
    also_serve = also_serve or []
    _check_names([set(served_model_names or ()), *(set(model.served_model_names) for model in also_serve)])
    main = ModelEngines(EnginePool(scheduler_address), tokenizer, list(served_model_names or ()),
                        sampling_defaults or {}, max_tokens_cap)
    gateway = Gateway([main, *also_serve], stream_interval=stream_interval,
                      request_log=RequestLog(log_requests, log_outputs, max_log_len),
                      tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                      max_client_batch_size=max_client_batch_size, body_read_timeout=body_read_timeout,
                      trust_request_chat_template=trust_request_chat_template,
                      max_concurrent_requests=max_concurrent_requests,
                      prompt_tokens_details=prompt_tokens_details, force_include_usage=force_include_usage,
                      return_tokens_as_token_ids=return_tokens_as_token_ids, response_role=response_role,
                      content_format=content_format, responses=ResponseStore(responses_store_mb << 20, responses_store_ttl))
    errors = error_middleware({"/v1/messages": anthropic_api.encode_error, "/api/": ollama_api.encode_error})
    middlewares = [request_id_middleware, requests_middleware(gateway.metrics.registry), errors,
                   gateway.drain.middleware]
    if allowed_hosts is not None:
        middlewares.insert(middlewares.index(errors) + 1, host_middleware(allowed_hosts))
    browsers = CORS(cors) if cors and cors.origins else None
    if browsers:
        middlewares.append(browsers.preflight)
    if api_key:
        # SageMaker's health checks, on /ping, carry no key.
        open_paths = {"/health", "/ping"} if protect_metrics else {"/health", "/ping", "/metrics"}
        middlewares.append(auth_middleware(api_key, frozenset(open_paths)))
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    if browsers:
        app.on_response_prepare.append(browsers.on_prepare)
    app.on_response_prepare.append(_server_header)
    app[GATEWAY] = gateway
    app.on_startup.append(_startup)
    app.on_cleanup.append(_cleanup)
    app.router.add_get("/health", ops_routes.health)
    app.router.add_get("/ping", ops_routes.health)
    app.router.add_post("/ping", ops_routes.health)
    app.router.add_post("/invocations", sagemaker.invocations)
    app.router.add_get("/version", ops_routes.version_info)
    app.router.add_get("/load", ops_routes.load)
    app.router.add_get("/metrics", ops_routes.metrics)
    app.router.add_get("/v1/models", routes.list_models)
    app.router.add_get("/v1/models/{model:.+}", routes.get_model)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_post("/v1/embeddings", pooling_routes.embeddings)
    for path in ("/rerank", "/v1/rerank"):
        app.router.add_post(path, pooling_routes.rerank)
    app.router.add_post("/v2/rerank", pooling_routes.rerank_v2)
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, pooling_routes.score)
    for path in ("/classify", "/v1/classify"):
        app.router.add_post(path, pooling_routes.classify)
    app.router.add_post("/v1/messages", anthropic_api.messages)
    app.router.add_post("/v1/messages/count_tokens", anthropic_api.count_tokens)
    app.router.add_post("/api/chat", ollama_api.chat)
    app.router.add_post("/api/generate", ollama_api.generate)
    app.router.add_get("/api/tags", ollama_api.tags)
    app.router.add_post("/api/show", ollama_api.show)
    app.router.add_get("/api/ps", ollama_api.ps)
    app.router.add_get("/api/version", ollama_api.version)
    app.router.add_post("/api/embed", ollama_api.embed)
    app.router.add_post("/api/embeddings", ollama_api.embeddings)
    app.router.add_post("/v1/responses", responses_api.create_response)
    app.router.add_get("/v1/responses/{response_id}", responses_api.get_response)
    app.router.add_delete("/v1/responses/{response_id}", responses_api.delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", responses_api.list_input_items)
    app.router.add_post("/v1/responses/{response_id}/cancel", responses_api.cancel_response)
    app.router.add_post("/tokenize", tokenize_routes.tokenize)
    app.router.add_post("/detokenize", tokenize_routes.detokenize)
    if batch_dir is not None:
        app[BATCHES] = BatchRunner(gateway, BatchStore(batch_dir), batch_concurrency, batch_max_file_mb << 20)
        _add_batch_routes(app.router)
    return app


def _add_batch_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/files", files_api.upload)
    router.add_get("/v1/files", files_api.list_files)
    router.add_get("/v1/files/{file_id}", files_api.get_file)
    router.add_delete("/v1/files/{file_id}", files_api.delete_file)
    router.add_get("/v1/files/{file_id}/content", files_api.file_content)
    router.add_post("/v1/batches", batches_api.create_batch)
    router.add_get("/v1/batches", batches_api.list_batches)
    router.add_get("/v1/batches/{batch_id}", batches_api.get_batch)
    router.add_post("/v1/batches/{batch_id}/cancel", batches_api.cancel_batch)
