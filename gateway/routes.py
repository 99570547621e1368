"""HTTP handlers: the OpenAI routes, /v1/models and /health."""
import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from gateway import params
from gateway.engine_client import EngineClient, ModelSpec
from gateway.errors import APIError, bad_request, internal, model_not_found
from gateway.generation import Choice, ChoiceEvent, Generation, fan_out
from gateway.request_id import current_request_id
from gateway.responses import ChatResponses, CompletionResponses, ResponseBuilder
from gateway.schemas import (ChatCompletionRequest, CompletionRequest, Model, ModelList, SamplingFields,
                             decode_request)
from gateway.sse import SSEWriter
from gateway.tokenizer import Tokenizer
from pagedserve.log import get_logger

log = get_logger(__name__)
_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class Gateway:
    """What the handlers share: the engine connection, the tokenizer and the name clients use."""
    engine: EngineClient
    tokenizer: Tokenizer
    served_model_name: str | None = None
    started: int = field(default_factory=lambda: int(time.time()))

    async def model(self) -> tuple[str, ModelSpec]:
        spec = await self.engine.model_spec()
        return self.served_model_name or spec.served_model_name, spec


GATEWAY = web.AppKey("gateway", Gateway)


def _json(body: msgspec.Struct) -> web.Response:
    return web.Response(body=_encoder.encode(body), content_type="application/json")


async def _read(request: web.Request, kind: type[SamplingFields]) -> SamplingFields:
    if request.content_type != "application/json":
        raise bad_request(f"Content-Type must be application/json, not '{request.content_type}'.")
    return decode_request(await request.read(), kind)


async def _card(gateway: Gateway) -> Model:
    name, spec = await gateway.model()
    return Model(id=name, created=gateway.started, max_model_len=spec.max_model_len)


async def list_models(request: web.Request) -> web.Response:
    return _json(ModelList([await _card(request.app[GATEWAY])]))


async def get_model(request: web.Request) -> web.Response:
    card = await _card(request.app[GATEWAY])
    if request.match_info["model"] != card.id:
        raise model_not_found(request.match_info["model"])
    return _json(card)


async def health(request: web.Request) -> web.Response:
    """200 while the scheduler answers GetModelInfo; 503 otherwise."""
    await request.app[GATEWAY].engine.model_info()
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await _read(request, ChatCompletionRequest)
    gateway = request.app[GATEWAY]
    served, spec = await gateway.model()
    model = params.resolve_model(req.model, served)
    params.check_chat_options(req)
    prompts = [params.chat_prompt(gateway.tokenizer, req)]
    rid = _new_id()
    choices = _choices(rid, req, prompts, req.max_completion_tokens or req.max_tokens, spec)
    builder = ChatResponses(rid, model, len(choices), _include_usage(req))
    return await _generate(request, builder, choices, req.stream)


async def completions(request: web.Request) -> web.StreamResponse:
    req = await _read(request, CompletionRequest)
    gateway = request.app[GATEWAY]
    served, spec = await gateway.model()
    model = params.resolve_model(req.model, served)
    params.check_completion_options(req)
    prompts, texts = params.completion_prompts(gateway.tokenizer, req.prompt)
    rid = _new_id()
    choices = _choices(rid, req, prompts, req.max_tokens, spec)
    echo = [""] * len(choices)
    if req.echo:
        echo = [texts[c.index // req.n] or gateway.tokenizer.decode(c.prompt_token_ids) for c in choices]
    builder = CompletionResponses(rid, model, len(choices), _include_usage(req), echo)
    return await _generate(request, builder, choices, req.stream)


def _new_id() -> str:
    # Client request ids may repeat (retries, proxies); engine request ids must not.
    return uuid.uuid4().hex


def _include_usage(req: SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _choices(rid: str, req: SamplingFields, prompts: list[list[int]], max_tokens: int | None,
             spec: ModelSpec) -> list[Choice]:
    params.check_prompts(prompts, spec.vocab_size)
    params.check_token_ids(req.stop_token_ids or [], spec.vocab_size, "stop_token_ids")
    params.check_context(prompts, max_tokens, spec.max_model_len)
    return fan_out(rid, prompts, params.sampling_params(req, max_tokens))


async def _generate(request: web.Request, builder: ResponseBuilder, choices: list[Choice],
                    stream: bool) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    generation = Generation(gateway.engine, gateway.tokenizer, choices, current_request_id())
    start = time.monotonic()
    try:
        async with aclosing(generation.events()) as events:
            if stream:
                return await _stream(request, builder, generation, events, start)
            return await _collect(builder, generation, events, start)
    except asyncio.CancelledError:
        _log_end("client_disconnected", builder, generation, start)
        raise


def _log_end(event: str, builder: ResponseBuilder, generation: Generation, start: float) -> None:
    usage = generation.usage()
    log.info(event, id=builder.id, prompt_tokens=usage.prompt_tokens,
             completion_tokens=usage.completion_tokens, elapsed_s=round(time.monotonic() - start, 3))


async def _collect(builder: ResponseBuilder, generation: Generation, events: AsyncIterator[ChoiceEvent],
                   start: float) -> web.Response:
    texts: list[list[str]] = [[] for _ in generation.choices]
    finals = []
    async for event in events:
        texts[event.index].append(event.text)
        if event.finish_reason is not None:
            finals.append(event)
    finals.sort(key=lambda e: e.index)
    _log_end("request_finished", builder, generation, start)
    return _json(builder.response(["".join(t) for t in texts], finals, generation.usage()))


async def _stream(request: web.Request, builder: ResponseBuilder, generation: Generation,
                  events: AsyncIterator[ChoiceEvent], start: float) -> web.StreamResponse:
    # Wait for the first text before sending headers, so that early failures get a real status code.
    first = await anext(events)
    sse = await SSEWriter.open(request)
    try:
        for chunk in builder.openings():
            await sse.send(chunk)
        await sse.send(builder.chunk(first))
        async for event in events:
            await sse.send(builder.chunk(event))
        if builder.include_usage:
            await sse.send(builder.usage_chunk(generation.usage()))
    except ConnectionResetError:
        # The client left; the caller closing `events` cancels the engine calls.
        _log_end("client_disconnected", builder, generation, start)
        return sse.response
    except APIError as e:
        log.info("stream_failed", status=e.status, message=e.info.message)
        await sse.send_error(e)
    except Exception:
        log.exception("stream_crashed")
        await sse.send_error(internal())
    await sse.close()
    _log_end("request_finished", builder, generation, start)
    return sse.response
