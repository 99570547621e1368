"""The Ollama API: /api/chat and /api/generate (NDJSON streams, on by default), /api/tags, /api/show,
/api/ps and /api/version, a translator between Ollama's wire and the request plan; /api/embed and
the legacy /api/embeddings, on the embeddings routes' pooling."""
import hashlib
import time

import msgspec
from aiohttp import web

from pagedserve.gateway import ollama_request as translate
from pagedserve.gateway import params, pooling_routes
from pagedserve.gateway.admission import engine_route, served_for
from pagedserve.gateway.errors import APIError, bad_request
from pagedserve.gateway.ollama_output import Clock, Replies, error_body, timestamp
from pagedserve.gateway.ollama_schemas import (ChatRequest, EmbeddingsRequest, EmbeddingsResponse, EmbedRequest,
                                               EmbedResponse, GenerateRequest, GenerationFields, ModelDetails,
                                               ModelEntry, ModelRequest, Options, PsResponse, RunningModel,
                                               ShowResponse, TagsResponse, VersionResponse)
from pagedserve.gateway.pooling_inputs import split_inputs
from pagedserve.gateway.request_id import HEADER, current_request_id
from pagedserve.gateway.request_plan import TOP_LOGPROBS_NAMES, NeutralRequest, plan
from pagedserve.gateway.schemas import SamplingFields
from pagedserve.gateway.serving import json_response, read_json, run
from pagedserve.gateway.state import GATEWAY, Gateway, ServedModel
from pagedserve.v1 import engine_pb2 as pb

_encoder = msgspec.json.Encoder()
# Ollama's names of the generation-config defaults that /api/show lists as parameters.
_PARAMETER_NAMES = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}
# The model never unloads: /api/ps says so with the latest time a client will parse.
_NEVER = "9999-12-31T23:59:59Z"
# What /api/version reports: the Ollama release whose API (docs/api.md) these routes follow. Clients
# gate on it (VS Code's Copilot refuses a server below 0.6.4); pagedserve's own version is at /version.
OLLAMA_API_VERSION = "0.32.15"


def encode_error(error: APIError) -> bytes:
    return _encoder.encode(error_body(error))


class NDJSONWriter:
    """One JSON object per line, as Ollama streams."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> "NDJSONWriter":
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", HEADER: current_request_id()})
        await response.prepare(request)
        return cls(response)

    async def send(self, line: msgspec.Struct) -> None:
        await self.response.write(_encoder.encode(line) + b"\n")

    async def close(self) -> None:
        await self.response.write_eof()


def _model_name(name: str) -> str:
    # Ollama names carry a tag, ":latest" when none is given; the served name has none.
    return name.removesuffix(":latest")


def _sampling(req: GenerationFields) -> SamplingFields:
    o = req.options or Options()
    return SamplingFields(model=_model_name(req.model), temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                          min_p=o.min_p, seed=o.seed, stop=o.stop, repetition_penalty=o.repeat_penalty,
                          presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty,
                          stream=req.stream)


def _neutral(req: GenerationFields, **chat) -> NeutralRequest:
    fmt = translate.constraint(req.format)
    return NeutralRequest(_sampling(req), constraint=None if fmt is None else ("format", fmt),
                          max_tokens=translate.max_tokens((req.options or Options()).num_predict),
                          logprobs=req.top_logprobs if req.logprobs else None,
                          field_names=TOP_LOGPROBS_NAMES, **chat)


def _loaded(req: GenerationFields, chat: bool) -> web.Response:
    """What Ollama answers a request with nothing to generate from: the model is loaded (it always is)."""
    return json_response(Replies("", req.model, chat, Clock()).line(end={"done_reason": "load"}))


@engine_route
async def chat(request: web.Request) -> web.StreamResponse:
    clock = Clock()
    req = await read_json(request, ChatRequest, any_type=True)
    gateway = request.app[GATEWAY]
    served = await served_for(request, _model_name(req.model))
    if not req.messages:
        return _loaded(req, chat=True)
    neutral = _neutral(req, messages=translate.chat_messages(req.messages), tools=req.tools,
                       chat_template_kwargs=translate.template_kwargs(req.think), drop_oldest_turns=req.truncate)
    p = await plan(gateway, served, neutral)
    return await run(request, p, Replies(p.id, req.model, True, clock, req.logprobs), NDJSONWriter.open)


@engine_route
async def generate(request: web.Request) -> web.StreamResponse:
    clock = Clock()
    req = await read_json(request, GenerateRequest, any_type=True)
    gateway = request.app[GATEWAY]
    served = await served_for(request, _model_name(req.model))
    translate.check_generate(req)
    if not req.prompt:
        return _loaded(req, chat=False)
    if req.raw:
        neutral = _neutral(req, prompts=[req.prompt])
    else:
        neutral = _neutral(req, messages=translate.generate_messages(req),
                           chat_template_kwargs=translate.template_kwargs(req.think))
    p = await plan(gateway, served, neutral)
    return await run(request, p, Replies(p.id, req.model, False, clock, req.logprobs), NDJSONWriter.open)


@engine_route
async def embed(request: web.Request) -> web.Response:
    start = time.perf_counter_ns()
    req = await read_json(request, EmbedRequest, any_type=True)
    gateway = request.app[GATEWAY]
    served = await served_for(request, _model_name(req.model))
    pooling_routes.check_embedder(served, "/api/embed")
    # As Ollama: no input (absent, "" or []) loads the model, which is always loaded.
    if not req.input:
        return json_response(EmbedResponse(model=req.model, embeddings=[]))
    given = split_inputs(req.input, gateway.max_client_batch_size)
    spec = served.spec
    vectors, tokens = await pooling_routes.embed(request.app[GATEWAY], served,
                                                 translate.embed_inputs(given, req.truncate, spec.max_model_len),
                                                 translate.embed_params(req.dimensions, spec.embedding_size))
    return json_response(EmbedResponse(model=req.model, embeddings=vectors,
                                       total_duration=time.perf_counter_ns() - start, prompt_eval_count=tokens))


@engine_route
async def embeddings(request: web.Request) -> web.Response:
    """The legacy /api/embeddings: one prompt's embedding as the model gives it."""
    req = await read_json(request, EmbeddingsRequest, any_type=True)
    served = await served_for(request, _model_name(req.model))
    pooling_routes.check_embedder(served, "/api/embeddings")
    if not req.prompt:
        return json_response(EmbeddingsResponse([]))
    params.check_prompt_chars(len(req.prompt), "prompt")
    vectors, _ = await pooling_routes.embed(request.app[GATEWAY], served, translate.prompt_input(req.prompt),
                                            pb.PoolingParams(task="embed"))
    return json_response(EmbeddingsResponse(vectors[0]))


def _entry(gateway: Gateway, served: ServedModel) -> dict:
    """What /api/tags and /api/ps say of the served model. The gateway knows neither its size nor its
    architecture: those are left empty (0, "")."""
    return dict(name=served.name, model=served.name, modified_at=timestamp(gateway.started), size=0,
                digest=hashlib.sha256(served.name.encode()).hexdigest(), details=ModelDetails())


async def tags(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    return json_response(TagsResponse([ModelEntry(**_entry(gateway, served)) for served in await gateway.served_models()]))


async def ps(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    return json_response(PsResponse([RunningModel(**_entry(gateway, served), expires_at=_NEVER, size_vram=0,
                                                   context_length=served.spec.max_model_len)
                                      for served in await gateway.served_models()]))


async def show(request: web.Request) -> web.Response:
    req = await read_json(request, ModelRequest, any_type=True)
    gateway = request.app[GATEWAY]
    name = req.model or req.name
    if not name:
        raise bad_request("Name the model as `model`.", param="model")
    served = await served_for(request, _model_name(name))
    return json_response(ShowResponse(
        modelfile="", template="", details=ModelDetails(), modified_at=timestamp(gateway.started),
        parameters="\n".join(f"{_PARAMETER_NAMES.get(k, k):<30} {v}" for k, v in served.sampling_defaults.items()),
        # Clients read the context length under "<general.architecture>.context_length".
        model_info={"general.architecture": "pagedserve", "general.basename": served.name,
                    "pagedserve.context_length": served.spec.max_model_len},
        capabilities=_capabilities(gateway)))


def _capabilities(gateway: Gateway) -> list[str]:
    return (["completion"] + ["tools"] * (gateway.tool_parser is not None)
            + ["thinking"] * (gateway.reasoning_parser is not None))


async def version(request: web.Request) -> web.Response:
    return json_response(VersionResponse(OLLAMA_API_VERSION))
