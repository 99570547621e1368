"""Ollama's /api/embed and legacy /api/embeddings over the fake engine's Pool, through the ollama
client and raw: the vectors, what reaches the engine (normalised, cut to `dimensions`, inputs cut
from their end), the counts, and what they refuse (past --max-concurrent-requests too), in
Ollama's error shape and never a 500."""
import asyncio
import json

import ollama
import pytest

from tests.gateway.fake_engine import LEAK, MAX_MODEL_LEN, MODEL, embedded
from tests.gateway.test_metrics import scrape, value

TEXTS = ["The quick brown fox", "Hello world! Hello there"]
LONG = "x " * 300


async def test_embed_single_and_batched_are_the_normalised_embeddings(embedder, serve, http, tokenizer):
    url = await serve()
    client = ollama.AsyncClient(host=url)
    single = await client.embed(model=f"{MODEL}:latest", input=TEXTS[0])
    batched = await client.embed(model=MODEL, input=TEXTS, keep_alive="5m", options={"temperature": 0.5})
    assert single.model == f"{MODEL}:latest" and batched.model == MODEL
    assert single.embeddings == [pytest.approx(embedded(tokenizer.encode(TEXTS[0])), abs=1e-6)]
    assert batched.embeddings == [pytest.approx(embedded(tokenizer.encode(t)), abs=1e-6) for t in TEXTS]
    tokens = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert batched.prompt_eval_count == tokens and batched.total_duration > 0
    assert {(r.params.task, r.params.normalize, r.params.dimensions) for r in embedder.pool_requests} == {
        ("embed", True, 0)}
    m = await scrape(http, url)
    assert value(m, "pooling_requests_total", endpoint="embeddings") == 2
    assert value(m, "pooling_prompt_tokens_total", endpoint="embeddings") == tokens + len(tokenizer.encode(TEXTS[0]))


async def test_dimensions_cut_any_size_and_renormalise(embedder, serve, tokenizer):
    client = ollama.AsyncClient(host=await serve())
    ids = tokenizer.encode(TEXTS[0])
    # 3 is not among the model's Matryoshka sizes (2 and 4): Ollama cuts any model's vectors.
    cut = await client.embed(model=MODEL, input=TEXTS[0], dimensions=3)
    assert cut.embeddings[0] == pytest.approx(embedded(ids, dimensions=3), abs=1e-6)
    for past in (100, 2 ** 70):
        whole = await client.embed(model=MODEL, input=TEXTS[0], dimensions=past)
        assert whole.embeddings[0] == pytest.approx(embedded(ids), abs=1e-6)


async def test_truncate_cuts_the_end_after_the_default_prompt_or_refuses(embedder, serve, tokenizer):
    embedder.pooling["default_prompt"] = "query: "
    client = ollama.AsyncClient(host=await serve())
    reply = await client.embed(model=MODEL, input=LONG)
    kept = tokenizer.encode_head("query: " + LONG, MAX_MODEL_LEN)
    assert list(embedder.pool_requests[-1].prompt_token_ids) == kept and reply.prompt_eval_count == MAX_MODEL_LEN
    assert kept[:4] == tokenizer.encode("query: x")[:4]
    with pytest.raises(ollama.ResponseError) as e:
        await client.embed(model=MODEL, input=LONG, truncate=False)
    assert e.value.status_code == 400 and "`truncate`" in e.value.error


async def test_no_input_answers_empty_without_engine_work(embedder, serve):
    client = ollama.AsyncClient(host=await serve())
    for given in ("", []):
        assert (await client.embed(model=MODEL, input=given)).embeddings == []
    assert (await client.embeddings(model=MODEL)).embedding == []
    assert embedder.pool_requests == []


async def test_legacy_embeddings_is_the_models_own_vector(embedder, serve, tokenizer):
    client = ollama.AsyncClient(host=await serve())
    reply = await client.embeddings(model=MODEL, prompt=TEXTS[1])
    assert reply.embedding == pytest.approx(embedded(tokenizer.encode(TEXTS[1])), abs=1e-6)
    # normalize unset: the model's default, as Ollama's route returns its runner's vector.
    assert not embedder.pool_requests[0].params.HasField("normalize")
    with pytest.raises(ollama.ResponseError) as e:
        await client.embeddings(model=MODEL, prompt=LONG)
    assert e.value.status_code == 400 and "/api/embed" in e.value.error


HOSTILE = [
    ("/api/embed", {}), ("/api/embed", {"model": "", "input": "hi"}), ("/api/embed", {"model": MODEL, "input": 5}),
    ("/api/embed", {"model": MODEL, "input": [1, 2]}), ("/api/embed", {"model": MODEL, "input": {"a": 1}}),
    ("/api/embed", {"model": MODEL, "input": ["a", ""]}), ("/api/embed", {"model": MODEL, "input": ["hi"] * 5000}),
    ("/api/embed", {"model": MODEL, "input": "hi", "dimensions": -1}),
    ("/api/embed", {"model": MODEL, "input": "hi", "dimensions": "4"}),
    ("/api/embed", {"model": MODEL, "input": "hi", "truncate": "no"}),
    ("/api/embed", {"model": MODEL, "input": "hi", "options": {"temperature": "hot"}}),
    ("/api/embed", {"model": MODEL, "input": LONG, "truncate": False}),
    ("/api/embed", {"model": "other", "input": "hi"}), ("/api/embed", b"{not json"), ("/api/embed", b"[]"),
    ("/api/embed", b"null"), ("/api/embeddings", {"prompt": "hi"}), ("/api/embeddings", {"model": MODEL, "prompt": 5}),
    ("/api/embeddings", {"model": MODEL, "prompt": ["a"]}), ("/api/embeddings", {"model": MODEL, "prompt": LONG}),
    ("/api/embeddings", {"model": "other", "prompt": "hi"}),
]


async def _error(http, url: str, path: str, body) -> tuple[int, dict]:
    # As `curl -d` sends it: Ollama reads any body as JSON.
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url + path, data=data, headers={"Content-Type": "application/x-www-form-urlencoded"}) as r:
        return r.status, await r.json()


async def test_hostile_bodies_get_ollama_shaped_4xx(embedder, serve, http):
    url = await serve()
    for path, body in HOSTILE:
        status, error = await _error(http, url, path, body)
        assert 400 <= status < 500 and list(error) == ["error"] and error["error"], (path, body, status)
        assert not LEAK.search(error["error"]), error
    assert embedder.pool_requests == []


async def test_a_generation_model_refuses_both_routes(base_url, http):
    for path, body in (("/api/embed", {"model": MODEL, "input": "hi"}), ("/api/embeddings", {"model": MODEL,
                                                                                           "prompt": "hi"})):
        status, error = await _error(http, base_url, path, body)
        assert status == 400 and "--runner pooling" in error["error"] and path in error["error"]


async def test_past_max_concurrent_requests_a_503_in_ollamas_shape(embedder, serve, http):
    url = await serve(max_concurrent_requests=1)
    embedder.delay = 0.3
    body = {"model": MODEL, "input": "hi"}
    first = asyncio.create_task(http.post(url + "/api/embed", json=body))
    async with asyncio.timeout(5):
        while not embedder.pool_requests:
            await asyncio.sleep(0.01)
    for path, second in (("/api/embed", body), ("/api/embeddings", {"model": MODEL, "prompt": "hi"})):
        status, error = await _error(http, url, path, second)
        assert status == 503 and list(error) == ["error"] and "--max-concurrent-requests" in error["error"]
    async with await first as r:
        assert r.status == 200 and len((await r.json())["embeddings"]) == 1
