"""/rerank, /v1/rerank, /v2/rerank and /score over the fake engine's Pool, with Dify's calls replayed,
the cohere SDK, and the checks, limits and metrics every engine route has."""
import asyncio

import aiohttp
import cohere
import pytest
import requests

from pagedserve.common.tokenizer import Tokenizer
from pagedserve.gateway.cors import CorsRules
from pagedserve.gateway.pooling_outputs import cosine
from pagedserve.gateway.state import GATEWAY
from tests.gateway.fake_engine import LEAK, MODEL, classified, embedded, serve_live_gateway
from tests.gateway.test_metrics import scrape, value

QUERY = "What is the capital of the United States?"
# Dify's credential check (models/openai_api_compatible/models/rerank/rerank.py in
# langgenius/dify-official-plugins), sent with every new rerank model.
DIFY_DOCS = [
    "Carson City is the capital city of the American state of Nevada. At the 2010 United States Census, Carson City "
    "had a population of 55,274.",
    "The Commonwealth of the Northern Mariana Islands is a group of islands in the Pacific Ocean that are a political "
    "division controlled by the United States. Its capital is Saipan.",
    "Washington, D.C., formally the District of Columbia, is the capital city and federal district of the United "
    "States. It is located on the east bank of the Potomac River.",
]


def pair_scores(tokenizer, query: str, documents: list[str]) -> list[float]:
    # The tiny tokenizer has no pair template: a decoder's pair is the texts joined (see score_inputs).
    return [classified(tokenizer.encode(query + d)) for d in documents]


def dify_post(url: str, payload: dict, api_key: str = "") -> requests.Response:
    """What Dify's OpenAI-API-compatible plugin sends: an empty Authorization header without a key."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}" if api_key else ""}
    return requests.post(url, headers=headers, json=payload, timeout=60)


async def test_dify_rerank_replay(reranker, serve, tokenizer):
    endpoint_url = f"{await serve(api_key='dify-key')}/v1"
    payload = {"model": MODEL, "query": QUERY, "documents": DIFY_DOCS, "top_n": 3}
    reply = await asyncio.to_thread(dify_post, f"{endpoint_url}/rerank", payload, "dify-key")
    assert reply.status_code == 200
    expected = pair_scores(tokenizer, QUERY, DIFY_DOCS)
    results = reply.json()["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])
    assert [r["relevance_score"] for r in results] == pytest.approx([expected[r["index"]] for r in results])
    assert [r["document"]["text"] for r in results] == [DIFY_DOCS[r["index"]] for r in results]
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == sum(len(tokenizer.encode(QUERY + d)) for d in DIFY_DOCS)
    unauthorized = await asyncio.to_thread(dify_post, f"{endpoint_url}/rerank", payload)
    assert unauthorized.status_code == 401


async def test_dify_embedding_replay(embedder, serve, tokenizer):
    endpoint_url = f"{await serve()}/v1"
    for extra in ({}, {"encoding_format": "float"}):
        payload = {"model": MODEL, "input": DIFY_DOCS, **extra}
        reply = await asyncio.to_thread(dify_post, f"{endpoint_url}/embeddings", payload)
        assert reply.status_code == 200
        body = reply.json()
        assert [d["embedding"] for d in body["data"]] == [pytest.approx(embedded(tokenizer.encode(d)), abs=1e-6)
                                                          for d in DIFY_DOCS]
        assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(d)) for d in DIFY_DOCS)


async def test_cohere_v2_rerank(reranker, serve, tokenizer):
    url = await serve()
    client = cohere.AsyncClientV2(base_url=url, api_key="EMPTY")
    reply = await client.rerank(model=MODEL, query=QUERY, documents=DIFY_DOCS, top_n=2)
    expected = pair_scores(tokenizer, QUERY, DIFY_DOCS)
    ranking = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r.index for r in reply.results] == ranking
    assert [r.relevance_score for r in reply.results] == pytest.approx([expected[i] for i in ranking])
    assert reply.meta.billed_units.search_units == 1
    assert reply.meta.tokens.input_tokens == sum(len(tokenizer.encode(QUERY + d)) for d in DIFY_DOCS)


async def test_rerank_v1_shapes_top_n_and_documents(reranker, serve, http, tokenizer):
    url = await serve()
    documents = ["a", {"text": "bb"}, "ccc", {"text": "dddd"}]
    texts = ["a", "bb", "ccc", "dddd"]
    expected = pair_scores(tokenizer, "q", texts)
    for path in ("/rerank", "/v1/rerank"):
        async with http.post(url + path, json={"query": "q", "documents": documents, "top_n": 0,
                                               "return_documents": False}) as r:
            results = (await r.json())["results"]
        assert [res["index"] for res in results] == sorted(range(4), key=lambda i: -expected[i])
        assert all("document" not in res for res in results)
    async with http.post(url + "/rerank", json={"query": "q", "documents": documents, "top_n": 2}) as r:
        results = (await r.json())["results"]
    assert [res["document"]["text"] for res in results] == [texts[res["index"]] for res in results]
    assert len(results) == 2
    async with http.post(url + "/rerank", json={"query": "q", "documents": texts, "use_activation": False}) as r:
        raw = {res["index"]: res["relevance_score"] for res in (await r.json())["results"]}
    assert raw[0] == pytest.approx((sum(tokenizer.encode("qa")) % 17 - 8) / 4)


async def test_score_pairs_as_vllm(reranker, serve, http, tokenizer):
    url = await serve()
    cases = [("q", "d", [("q", "d")]), ("q", ["d1", "d2"], [("q", "d1"), ("q", "d2")]),
             (["q1", "q2"], ["d1", "d2"], [("q1", "d1"), ("q2", "d2")]),
             (["q"], ["d1", "d2"], [("q", "d1"), ("q", "d2")])]
    for text_1, text_2, pairs in cases:
        for path in ("/score", "/v1/score"):
            async with http.post(url + path, json={"model": MODEL, "text_1": text_1, "text_2": text_2}) as r:
                body = await r.json()
            assert [d["index"] for d in body["data"]] == list(range(len(pairs)))
            assert {d["object"] for d in body["data"]} == {"score"} and body["object"] == "list"
            assert [d["score"] for d in body["data"]] == pytest.approx(
                [classified(tokenizer.encode(q + d)) for q, d in pairs])
            assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(q + d)) for q, d in pairs)


async def test_a_bi_encoder_scores_and_reranks_by_cosine(embedder, serve, http, tokenizer):
    url = await serve()
    async with http.post(url + "/score", json={"text_1": "q", "text_2": ["d1", "d2"]}) as r:
        scores = [d["score"] for d in (await r.json())["data"]]
    query = embedded(tokenizer.encode("q"))
    assert scores == pytest.approx([cosine(query, embedded(tokenizer.encode(d))) for d in ("d1", "d2")], abs=1e-5)
    # The query is embedded once for all its documents.
    assert sorted(tuple(r.prompt_token_ids) for r in embedder.pool_requests) == sorted(
        tuple(tokenizer.encode(t)) for t in ("q", "d1", "d2"))
    async with http.post(url + "/v1/rerank", json={"query": "q", "documents": ["d1", "d2"]}) as r:
        assert sorted(res["relevance_score"] for res in (await r.json())["results"]) == pytest.approx(sorted(scores),
                                                                                                     abs=1e-5)


HOSTILE = [
    ("/rerank", {"query": "q", "documents": []}, "documents"), ("/rerank", {"query": "q"}, None),
    ("/rerank", {"query": 1, "documents": ["a"]}, "query"), ("/rerank", {"query": "q", "documents": [1]}, "documents"),
    ("/rerank", {"query": "q", "documents": [{"txt": "a"}]}, "documents"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "q", "documents": ["a"] * 5000}, "documents"),
    ("/rerank", {"query": "q", "documents": ["word " * 300]}, "documents"),
    ("/v2/rerank", {"query": "q", "documents": "a"}, "documents"),
    ("/score", {"text_1": [], "text_2": ["a"]}, "text_1"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c"] * 3}, "text_2"),
    ("/score", {"text_1": "a", "text_2": {"x": 1}}, "text_2"), ("/score", {"text_1": "a"}, None),
    ("/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model"),
]


async def test_hostile_rerank_and_score_requests_get_openai_shaped_4xx(reranker, serve, http):
    url = await serve()
    for path, body, param in HOSTILE:
        async with http.post(url + path, json=body) as r:
            status, error = r.status, (await r.json())["error"]
        assert 400 <= status < 500 and error["type"] == "invalid_request_error", (path, body, error)
        assert (error["param"] or "").split("[")[0] == (param or ""), (path, body, error)
        assert not LEAK.search(error["message"])
    assert reranker.pool_requests == []


async def test_each_route_names_the_runner_a_model_lacks(engine, serve, http):
    url = await serve()
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/rerank", {"query": "q", "documents": ["a"]}),
                       ("/score", {"text_1": "a", "text_2": "b"})):
        async with http.post(url + path, json=body) as r:
            error = (await r.json())["error"]
        assert r.status == 400 and "--runner generate" in error["message"] and "--runner pooling" in error["message"]
    engine.runner = "pooling"
    engine.pooling = dict(pooling_tasks=["classify"], num_labels=2)
    url = await serve()
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        async with http.post(url + path, json=body) as r:
            assert r.status == 400 and "--runner pooling" in (await r.json())["error"]["message"]
    async with http.post(url + "/v1/embeddings", json={"input": "hi"}) as r:
        assert r.status == 400 and "classify" in (await r.json())["error"]["message"]
    async with http.post(url + "/rerank", json={"query": "q", "documents": ["a"]}) as r:
        assert r.status == 400 and "2 labels" in (await r.json())["error"]["message"]


async def test_metrics_count_pooling_requests_tokens_and_rejections(reranker, serve, http, tokenizer):
    url = await serve()
    for _ in range(2):
        async with http.post(url + "/rerank", json={"query": "q", "documents": ["a", "b"]}) as r:
            assert r.status == 200
    async with http.post(url + "/score", json={"text_1": "q", "text_2": "a"}) as r:
        assert r.status == 200
    async with http.post(url + "/score", json={"text_1": ["q", "r"], "text_2": ["a"] * 3}) as r:
        assert r.status == 400
    m = await scrape(http, url)
    rerank_tokens = 2 * sum(len(tokenizer.encode("q" + d)) for d in "ab")
    assert value(m, "pooling_requests_total", endpoint="rerank") == 2
    assert value(m, "pooling_requests_total", endpoint="score") == 1
    assert value(m, "pooling_prompt_tokens_total", endpoint="rerank") == rerank_tokens
    assert value(m, "prompt_tokens_total") == rerank_tokens + len(tokenizer.encode("qa"))
    assert value(m, "request_rejected_total", reason="invalid") == 1


async def test_a_client_that_leaves_aborts_its_pool_calls(reranker, serve, http):
    reranker.delay = 5
    url = await serve()
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(url + "/rerank", json={"query": "q", "documents": ["a", "b", "c"]},
                             timeout=aiohttp.ClientTimeout(total=0.3)) as r:
            await r.read()
    await reranker.wait_cancelled(3)
    assert len(reranker.cancelled) == 3


async def test_admission_and_shutdown_cover_pooling(reranker, tokenizer, http):
    reranker.delay = 5
    runner, url = await serve_live_gateway(tokenizer, reranker.address, max_concurrent_requests=1)
    try:
        first = asyncio.ensure_future(http.post(url + "/score", json={"text_1": "q", "text_2": "a"}))
        while not reranker.pool_requests:
            await asyncio.sleep(0.01)
        async with http.post(url + "/score", json={"text_1": "q", "text_2": "a"}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "server_overloaded"
        await runner.app[GATEWAY].drain.drain(0.1)
        reply = await first
        assert reply.status == 503 and "shutting down" in (await reply.json())["error"]["message"]
        reply.release()
    finally:
        await runner.cleanup()


async def test_cors_request_ids_and_the_body_limit_cover_the_pooling_routes(embedder, serve, http):
    origin = "https://app.example.com"
    url = await serve(api_key="k", cors=CorsRules([origin]))
    auth = {"Authorization": "Bearer k", "Origin": origin, "X-Request-Id": "rag-1"}
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/v2/rerank", {"query": "q", "documents": ["a"]}),
                       ("/v1/score", {"text_1": "a", "text_2": "b"})):
        async with http.options(url + path, headers={"Origin": origin, "Access-Control-Request-Method": "POST"}) as r:
            assert r.status == 204
        async with http.post(url + path, json=body, headers=auth) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == origin
            assert r.headers["X-Request-Id"] == "rag-1"
        async with http.post(url + path, json=body) as r:
            assert r.status == 401
    assert {m["x-request-id"] for m in embedder.metadata} == {"rag-1"}
    async with http.post(url + "/v1/embeddings", json={"input": "x" * (5 << 20)}, headers=auth) as r:
        assert r.status == 413 and (await r.json())["error"]["type"] == "invalid_request_error"


async def test_log_requests_logs_each_pooling_request(reranker, serve, http, capsys):
    url = await serve(log_requests=True)
    async with http.post(url + "/rerank", json={"query": "q", "documents": ["a", "b"]}) as r:
        assert r.status == 200
    captured = capsys.readouterr()
    line, = [line for line in (captured.out + captured.err).splitlines() if "request_finished" in line]
    assert "endpoint=rerank" in line and "inputs=2" in line and "prompt_tokens=" in line


async def test_a_decoder_reranker_gets_its_pairs_from_the_score_template(reranker, tokenizer_dir, http):
    # vLLM's score template for Qwen3-Reranker, passed as --chat-template (see common.score_inputs).
    template = ('<|im_start|>user\n<Query>: {{ messages | selectattr("role", "eq", "query") | map(attribute="content")'
                ' | first }}\n<Document>: {{ messages | selectattr("role", "eq", "document") | '
                'map(attribute="content") | first }}<|im_end|>\n<|im_start|>assistant\n')
    scorer = Tokenizer.from_dir(tokenizer_dir, chat_template=template)
    runner, url = await serve_live_gateway(scorer, reranker.address)
    try:
        async with http.post(url + "/rerank", json={"query": "q", "documents": ["a", "b"]}) as r:
            assert r.status == 200
    finally:
        await runner.cleanup()
    # (Jinja drops a template's final newline, as in transformers.)
    rendered = [f"<|im_start|>user\n<Query>: q\n<Document>: {d}<|im_end|>\n<|im_start|>assistant" for d in "ab"]
    assert sorted(list(r.prompt_token_ids) for r in reranker.pool_requests) == sorted(
        scorer.encode(text, add_special_tokens=False) for text in rendered)
