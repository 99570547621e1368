"""HTTP handlers of the OpenAI routes: /v1/models, /v1/completions and /v1/chat/completions."""
import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import msgspec
from aiohttp import web

from pagedserve.common.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.gateway import params, reasoning
from pagedserve.gateway.admission import admitted, check_runner, counts_rejections, served_for
from pagedserve.gateway.chat_output import ChatOutputOptions
from pagedserve.gateway.chat_prompt import chat_prompt
from pagedserve.gateway.errors import APIError, bad_request, internal, request_timeout
from pagedserve.gateway.generation import Choice, ChoiceEvent, Generation, fan_out
from pagedserve.gateway.logprobs import TokenLogprob
from pagedserve.gateway.request_id import current_request_id
from pagedserve.gateway.responses import ChatResponses, CompletionResponses, PromptLogprobs, ResponseBuilder
from pagedserve.gateway.schemas import (ChatCompletionRequest, CompletionRequest, Model, ModelList, SamplingFields,
                             decode_request)
from pagedserve.gateway.sse import SSEWriter
from pagedserve.gateway.state import GATEWAY, Gateway, ServedModel
from pagedserve.gateway.structured import checked, request_constraint
from pagedserve.gateway.tools import tool_options
from pagedserve.common.log import get_logger, loggable
from pagedserve.common.tokenizer import Tokenizer

log = get_logger(__name__)
_encoder = msgspec.json.Encoder()


def json_response(body: msgspec.Struct) -> web.Response:
    return web.Response(body=_encoder.encode(body), content_type="application/json")


async def read_json(request: web.Request, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """The body decoded into `kind`; a 400 for the wrong Content-Type or a body that does not fit,
    a 408 for a body slower than --body-read-timeout."""
    if request.content_type != "application/json":
        raise bad_request(f"Content-Type must be application/json, not '{request.content_type}'.")
    timeout = request.app[GATEWAY].body_read_timeout
    try:
        body = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise request_timeout(timeout) from None
    return decode_request(body, kind)


def _card(gateway: Gateway, served: ServedModel) -> Model:
    return Model(id=served.name, created=gateway.started, max_model_len=served.spec.max_model_len)


async def list_models(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    return json_response(ModelList([_card(gateway, served) for served in await gateway.served_models()]))


async def get_model(request: web.Request) -> web.Response:
    return json_response(_card(request.app[GATEWAY], await served_for(request, request.match_info["model"])))


@counts_rejections
@admitted
async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await read_json(request, ChatCompletionRequest)
    gateway = request.app[GATEWAY]
    served = await served_for(request, req.model)
    check_runner(served, "generate", "/v1/chat/completions")
    params.check_chat_options(req)
    params.check_fan_out(1, req.n, gateway.max_client_batch_size)
    options = ChatOutputOptions(reasoning=gateway.reasoning_parser is not None)
    constraint = await _checked(gateway, _chat_constraint(req, gateway, options))
    chat = params.chat_input(req.messages, req.tools, req.chat_template_kwargs, req.chat_template,
                             gateway.trust_request_chat_template)
    prompt = await chat_prompt(gateway, served.tokenizer, chat, req.add_generation_prompt)
    if options.reasoning and reasoning.ended_in_prompt(served.tokenizer.decode(prompt, False)):
        options.reasoning = False
    if options.reasoning and constraint is not None:
        _free_thinking(constraint, served.tokenizer)
    rid = _new_id()
    logprobs = params.chat_logprobs(req)
    choices = _choices(rid, req, [prompt], req.max_completion_tokens or req.max_tokens, logprobs, served,
                       constraint, req.prompt_logprobs)
    prompt_lp = None
    if req.prompt_logprobs is not None:
        if req.stream:
            raise bad_request("`prompt_logprobs` on chat completions is returned without `stream` only; "
                              "remove one of them.", param="prompt_logprobs")
        prompt_lp = PromptLogprobs(served.tokenizer, [c.prompt_token_ids for c in choices], vllm=True, echo=False)
    builder = ChatResponses(rid, served.name, len(choices), _include_usage(req), logprobs is not None, options,
                            prompt_lp)
    return await _generate(request, builder, choices, req.stream, served)


def _free_thinking(constraint: StructuredOutputsParams, tokenizer: Tokenizer) -> None:
    """Makes the constraint the answer's, leaving the thinking before </think> free. The end is
    found by token id, as vLLM does, so only where </think> is one token (a reasoning model's
    vocabulary); elsewhere the constraint covers the whole output."""
    end = tokenizer.encode(reasoning.END, add_special_tokens=False)
    if len(end) == 1:
        constraint.reasoning_end_ids = end


def _chat_constraint(req: ChatCompletionRequest, gateway: Gateway,
                     options: ChatOutputOptions) -> tuple[str, StructuredOutputsParams] | None:
    """What tool_choice forces (from `tools`), or else what the request asks for, and its field."""
    forced = tool_options(req, gateway.tool_parser, options)
    requested = request_constraint(req)
    if forced is not None and requested is not None:
        raise bad_request("tool_choice \"required\" or a named function constrains the output already; "
                          "remove `response_format` (or the structured outputs field).", param="tool_choice")
    return ("tools", forced) if forced is not None else requested


async def _checked(gateway: Gateway,
                   given: tuple[str, StructuredOutputsParams] | None) -> StructuredOutputsParams | None:
    """The constraint, checked (size and compilation) on the pool: a large one takes seconds."""
    if given is None:
        return None
    param, constraint = given
    return await gateway.in_pool(checked, constraint, param)


@counts_rejections
@admitted
async def completions(request: web.Request) -> web.StreamResponse:
    req = await read_json(request, CompletionRequest)
    gateway = request.app[GATEWAY]
    served = await served_for(request, req.model)
    check_runner(served, "generate", "/v1/completions")
    params.check_completion_options(req)
    given = params.split_prompts(req.prompt)
    params.check_fan_out(len(given), req.n, gateway.max_client_batch_size)
    prompts = given
    if isinstance(given[0], str):
        prompts = await gateway.offload(sum(map(len, given)), params.encode_prompts, served.tokenizer, given)
    rid = _new_id()
    # Echo with logprobs shows the prompt's tokens as OpenAI does, prompt_logprobs as vLLM does.
    asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    prompt_logprobs = max(asked) if asked else None
    constraint = await _checked(gateway, request_constraint(req))
    choices = _choices(rid, req, prompts, req.max_tokens, req.logprobs, served, constraint,
                       prompt_logprobs)
    echo = [""] * len(choices)
    if req.echo:
        echo = [await _echo_text(gateway, served.tokenizer, given[c.index // req.n]) for c in choices]
    prompt_lp = None
    if prompt_logprobs is not None:
        prompt_lp = PromptLogprobs(served.tokenizer, [c.prompt_token_ids for c in choices],
                                   vllm=req.prompt_logprobs is not None, echo=bool(req.echo and req.logprobs is not None))
    builder = CompletionResponses(rid, served.name, len(choices), _include_usage(req), req.logprobs is not None,
                                  echo, prompt_lp)
    return await _generate(request, builder, choices, req.stream, served)


async def _echo_text(gateway: Gateway, tokenizer: Tokenizer, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return await gateway.offload(len(prompt), tokenizer.decode, prompt)


def _new_id() -> str:
    # Client request ids may repeat (retries, proxies); engine request ids must not.
    return uuid.uuid4().hex


def _include_usage(req: SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _choices(rid: str, req: SamplingFields, prompts: list[list[int]], max_tokens: int | None,
             logprobs: int | None, served: ServedModel, constraint: StructuredOutputsParams | None = None,
             prompt_logprobs: int | None = None) -> list[Choice]:
    spec = served.spec
    # The length first: it costs nothing, while the vocabulary check reads every id.
    params.check_context(prompts, max_tokens, spec.max_model_len)
    params.check_prompts(prompts, spec.vocab_size)
    params.check_token_ids(req.stop_token_ids or [], spec.vocab_size, "stop_token_ids")
    bias = params.logit_bias(req.logit_bias, spec.vocab_size)
    params.check_stop(req.stop)
    sampling = params.sampling_params(req, max_tokens, logprobs, served.sampling_defaults, constraint,
                                      prompt_logprobs, bias)
    choices = fan_out(rid, prompts, sampling, req.cache_salt)
    served.metrics.request_params_n.observe(req.n)
    served.metrics.request_params_max_tokens.observe(
        max_tokens or spec.max_model_len - max(len(p) for p in prompts))
    return choices


async def _generate(request: web.Request, builder: ResponseBuilder, choices: list[Choice],
                    stream: bool, served: ServedModel) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    start = time.monotonic()
    generation = Generation(served.engines, served.tokenizer, choices, current_request_id(),
                            served.metrics, start, gateway.stream_interval, gateway.log_requests,
                            gateway.prompt_tokens_details)
    try:
        with gateway.drain.track(generation):
            async with aclosing(generation.events()) as events:
                if stream:
                    return await _stream(request, builder, generation, events, start)
                return await _collect(builder, generation, events, start)
    except asyncio.CancelledError:
        _client_left(builder, generation, start)
        raise


def _log_end(event: str, builder: ResponseBuilder, generation: Generation, start: float) -> None:
    usage = generation.usage()
    summary = dict(id=builder.id, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                   elapsed_s=round(time.monotonic() - start, 3))
    if not generation.log_requests:
        # Debug unless asked for: a line per request slows serving under load.
        log.debug(event, **summary)
        return
    choices = generation.choices
    log.info(event, **summary, finish_reasons=[c.finish_reason for c in choices],
             params=changed_fields(choices[0].params))


def changed_fields(params: SamplingParams) -> dict:
    """The sampling parameters a request set to other than their defaults, each cut to fit a log line."""
    default = type(params)()
    return {f.name: loggable(getattr(params, f.name)) for f in dataclasses.fields(params)
            if getattr(params, f.name) != getattr(default, f.name)}


def _client_left(builder: ResponseBuilder, generation: Generation, start: float) -> None:
    generation.metrics.client_disconnected.inc()
    _log_end("client_disconnected", builder, generation, start)


async def _collect(builder: ResponseBuilder, generation: Generation, events: AsyncIterator[ChoiceEvent],
                   start: float) -> web.Response:
    texts: list[list[str]] = [[] for _ in generation.choices]
    logprobs: list[list[TokenLogprob]] = [[] for _ in generation.choices]
    prompts: list = [None] * len(generation.choices)
    finals = []
    async for event in events:
        texts[event.index].append(event.text)
        logprobs[event.index] += event.logprobs
        if event.prompt_logprobs is not None:
            prompts[event.index] = event.prompt_logprobs
        if event.finish_reason is not None:
            finals.append(event)
    finals.sort(key=lambda e: e.index)
    _log_end("request_finished", builder, generation, start)
    return json_response(builder.response(["".join(t) for t in texts], logprobs, finals,
                                          generation.usage(), prompts))


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
        _client_left(builder, generation, start)
        return sse.response
    except APIError as e:
        log.info("stream_failed", status=e.status, message=loggable(e.info.message))
        await sse.send_error(e)
    except Exception:
        log.exception("stream_crashed")
        await sse.send_error(internal())
    await sse.close()
    _log_end("request_finished", builder, generation, start)
    return sse.response
