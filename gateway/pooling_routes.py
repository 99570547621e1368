"""HTTP handlers of the pooling routes: /v1/embeddings (OpenAI), /rerank, /v1/rerank (Jina, Cohere v1),
/v2/rerank (Cohere v2), /score, /v1/score and /classify, /v1/classify (vLLM), and their responses to
batch lines. Each input
is one Pool call (see pooling)."""
import asyncio
import time
import uuid

from aiohttp import web

from pagedserve.common.log import get_logger
from pagedserve.gateway import params
from pagedserve.gateway.admission import check_runner, engine_route, served_for
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.pooling import Pooling, PoolInput
from pagedserve.gateway.pooling_inputs import (EmbedInputs, check_count, check_lengths, check_task, check_token_input,
                                               check_top_n, embed_params, embedding_inputs, encode_texts,
                                               pair_inputs, score_pairs, text_inputs)
from pagedserve.gateway.pooling_outputs import cosines, encode_embedding, ranked
from pagedserve.gateway.pooling_schemas import (BilledUnits, ClassificationData, ClassificationRequest,
                                                ClassificationResponse, Embedding, EmbeddingRequest, EmbeddingResponse,
                                                EmbeddingUsage, MetaTokens, RerankMeta, RerankRequest,
                                                RerankResponse, RerankResult, RerankUsage, RerankV2Response,
                                                ScoreData, ScoreRequest, ScoreResponse)
from pagedserve.gateway.request_id import current_request_id
from pagedserve.gateway.serving import json_response, read_json
from pagedserve.gateway.schemas import Usage
from pagedserve.gateway.state import GATEWAY, Gateway, ServedModel
from pagedserve.v1 import engine_pb2 as pb

log = get_logger(__name__)
# Cohere bills a rerank by search units of up to this many documents.
_DOCUMENTS_PER_SEARCH_UNIT = 100


@engine_route
async def embeddings(request: web.Request) -> web.Response:
    return await _answer(request, EmbeddingRequest, embedding_response)


async def _answer(request: web.Request, kind: type, respond) -> web.Response:
    """The JSON response `respond(gateway, served model, request)` makes of the body, decoded as `kind`."""
    req = await read_json(request, kind)
    return json_response(await respond(request.app[GATEWAY], await served_for(request, req.model), req))


async def embedding_response(gateway: Gateway, served: ServedModel, req: EmbeddingRequest,
                             background: bool = False) -> EmbeddingResponse:
    """An embeddings request's response (the route's and a batch line's); a 400 APIError for what cannot run."""
    check_embedder(served, "/v1/embeddings")
    pooling = embed_params(req, served)
    inputs = embedding_inputs(req, gateway.max_client_batch_size, served.spec.max_model_len)
    vectors, tokens = await embed(gateway, served, inputs, pooling, background)
    data = [Embedding(i, encode_embedding(v, req.encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingResponse(f"embd-{uuid.uuid4().hex}", int(time.time()), served.name, data,
                             EmbeddingUsage(tokens, tokens))


def check_embedder(served: ServedModel, endpoint: str) -> None:
    """400 unless the model is a pooling model that embeds, as `endpoint` needs."""
    check_runner(served, "pooling", endpoint)
    check_task(served, "embed", endpoint)


async def embed(gateway: Gateway, served: ServedModel, inputs: EmbedInputs, pooling_params: pb.PoolingParams,
                background: bool = False) -> tuple[list[list[float]], int]:
    """Each input's embedding and their prompt tokens, for every embeddings route (OpenAI's, Ollama's)
    and batch lines (`background`): the inputs after the model's default prompt, fitted to the model,
    then pooled and counted under endpoint "embeddings". Check the model with check_embedder first."""
    prompts = await _prompts(gateway, served, inputs, served.spec.default_prompt)
    return await _pool(gateway, served, "embeddings", [PoolInput(p) for p in prompts], pooling_params, background)


async def _prompts(gateway: Gateway, served: ServedModel, inputs: EmbedInputs, prefix: str) -> list[list[int]]:
    """Each input as token ids (a text after `prefix`), cut as `inputs` says and checked against the
    vocabulary and the context."""
    spec = served.spec
    # Characters or token ids: either takes long enough past OFFLOAD_SIZE to hold other requests up.
    size = sum(map(len, inputs.given))
    if isinstance(inputs.given[0], str):
        prompts = await gateway.offload(size, encode_texts, served.tokenizer, inputs, prefix)
    else:
        prompts = await gateway.offload(size, check_token_input, inputs, spec.vocab_size)
    check_lengths(prompts, spec.max_model_len, inputs.too_long)
    return prompts


@engine_route
async def rerank(request: web.Request) -> web.Response:
    """Jina's and Cohere's v1 rerank, as vLLM answers it on /rerank and /v1/rerank."""
    return await _answer(request, RerankRequest, rerank_response)


async def rerank_response(gateway: Gateway, served: ServedModel, req: RerankRequest,
                          background: bool = False) -> RerankResponse:
    """A v1 rerank request's response (the route's and a batch line's); a 400 APIError for what cannot run."""
    results, tokens = await _rerank(gateway, served, req, True, background)
    return RerankResponse(f"rerank-{uuid.uuid4().hex}", served.name, RerankUsage(tokens, tokens), results)


@engine_route
async def rerank_v2(request: web.Request) -> web.Response:
    """Cohere's v2 rerank."""
    req = await read_json(request, RerankRequest)
    served = await served_for(request, req.model)
    results, tokens = await _rerank(request.app[GATEWAY], served, req, return_documents=False)
    units = -(-len(req.documents) // _DOCUMENTS_PER_SEARCH_UNIT)
    meta = RerankMeta(BilledUnits(units), MetaTokens(tokens))
    return json_response(RerankV2Response(str(uuid.uuid4()), results, meta, served.name, RerankUsage(tokens, tokens)))


async def _rerank(gateway: Gateway, served: ServedModel, req: RerankRequest, return_documents: bool,
                  background: bool = False) -> tuple[list[RerankResult], int]:
    if not req.documents:
        raise bad_request("`documents` is empty; send at least one document to rank.", param="documents")
    check_count(len(req.documents), gateway.max_client_batch_size, "documents")
    check_top_n(req.top_n)
    documents = [d if isinstance(d, str) else d.text for d in req.documents]
    pairs = [(req.query, d) for d in documents]
    scores, tokens = await _scores(gateway, served, "rerank", pairs, "documents", req.use_activation, background)
    keep = return_documents if req.return_documents is None else req.return_documents
    return ranked(scores, documents, req.top_n, keep), tokens


@engine_route
async def score(request: web.Request) -> web.Response:
    """vLLM's /score: text_1 against text_2, paired 1:1, 1:N or N:N."""
    return await _answer(request, ScoreRequest, score_response)


async def score_response(gateway: Gateway, served: ServedModel, req: ScoreRequest,
                         background: bool = False) -> ScoreResponse:
    """A score request's response (the route's and a batch line's); a 400 APIError for what cannot run."""
    pairs = score_pairs(req.text_1, req.text_2)
    check_count(len(pairs), gateway.max_client_batch_size, "text_2")
    scores, tokens = await _scores(gateway, served, "score", pairs, "text_2", req.use_activation, background)
    data = [ScoreData(i, s) for i, s in enumerate(scores)]
    return ScoreResponse(f"score-{uuid.uuid4().hex}", int(time.time()), served.name, data,
                         Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens))


@engine_route
async def classify(request: web.Request) -> web.Response:
    """vLLM's /classify: each input's class probabilities and its most probable class."""
    return await _answer(request, ClassificationRequest, classify_response)


async def classify_response(gateway: Gateway, served: ServedModel,
                            req: ClassificationRequest) -> ClassificationResponse:
    """A classification request's response; a 400 APIError for what cannot run."""
    check_runner(served, "pooling", "/classify")
    check_task(served, "classify", "/classify")
    inputs = embedding_inputs(req, gateway.max_client_batch_size, served.spec.max_model_len)
    prompts = await _prompts(gateway, served, inputs, "")
    params = pb.PoolingParams(task="classify", activation=req.use_activation)
    outputs, tokens = await _pool(gateway, served, "classify", [PoolInput(p) for p in prompts], params)
    data = [ClassificationData(i, _label(served.spec.labels, probs), probs, len(probs))
            for i, probs in enumerate(outputs)]
    return ClassificationResponse(f"classify-{uuid.uuid4().hex}", int(time.time()), served.name, data,
                                  Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens))


def _label(labels: tuple[str, ...], probs: list[float]) -> str:
    best = max(range(len(probs)), key=probs.__getitem__)
    return labels[best] if labels else f"LABEL_{best}"


async def _scores(gateway: Gateway, served: ServedModel, endpoint: str, pairs: list[tuple[str, str]],
                  param: str, activation: bool | None, background: bool) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens run: a cross-encoder's (a one-label classifier)
    classifies each pair, a bi-encoder's (embed only) is the cosine of the two embeddings."""
    spec = served.spec
    check_runner(served, "pooling", f"/{endpoint}")
    size = sum(len(q) + len(d) for q, d in pairs)
    params.check_prompt_chars(size, param)
    if "classify" in spec.pooling_tasks:
        if spec.num_labels != 1:
            raise bad_request(f"The model `{served.name}` classifies into {spec.num_labels} labels; scoring needs a "
                              "one-label classifier (a cross-encoder) or an embedding model.", param="model")
        inputs = await gateway.offload(size, pair_inputs, served.tokenizer, pairs, spec, param)
        outputs, tokens = await _pool(gateway, served, endpoint, inputs,
                                      pb.PoolingParams(task="classify", activation=activation), background)
        return [o[0] for o in outputs], tokens
    check_task(served, "embed", f"/{endpoint}")
    # Each distinct text is embedded once: a rerank's query serves every document.
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    inputs = await gateway.offload(size, text_inputs, served.tokenizer, texts, spec, param)
    vectors, tokens = await _pool(gateway, served, endpoint, inputs, pb.PoolingParams(task="embed"), background)
    # A thousand documents of a large model are a million products: off the event loop.
    scores = await gateway.offload(len(pairs) * len(vectors[0]), cosines, pairs, dict(zip(texts, vectors)))
    return scores, tokens


async def _pool(gateway: Gateway, served: ServedModel, endpoint: str, inputs: list[PoolInput],
                pooling_params: pb.PoolingParams, background: bool = False) -> tuple[list[list[float]], int]:
    """Each input's pooled data and their prompt tokens, counted in the metrics and logged."""
    start = time.monotonic()
    pooling = Pooling(served.engines, inputs, pooling_params, current_request_id(), background)
    try:
        with gateway.drain.track(pooling):
            outputs = await pooling.run()
    except asyncio.CancelledError:
        served.metrics.client_disconnected.inc()
        _log_end("client_disconnected", gateway.request_log.enabled, endpoint, pooling, start)
        raise
    metrics, tokens = served.metrics, pooling.prompt_tokens
    metrics.pooling_requests[endpoint].inc()
    metrics.pooling_prompt_tokens[endpoint].inc(tokens)
    metrics.prompt_tokens.inc(tokens)
    _log_end("request_finished", gateway.request_log.enabled, endpoint, pooling, start)
    return outputs, tokens


def _log_end(event: str, log_requests: bool, endpoint: str, pooling: Pooling, start: float) -> None:
    # Debug unless asked for (--enable-log-requests): a line per request slows serving under load.
    emit = log.info if log_requests else log.debug
    emit(event, endpoint=endpoint, inputs=len(pooling.inputs), prompt_tokens=pooling.prompt_tokens,
         elapsed_s=round(time.monotonic() - start, 3))
