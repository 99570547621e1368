"""SageMaker's routes: /ping answers as /health (without the API key), /invocations runs each kind
of body on its route."""
import pytest

from tests.gateway.fake_engine import MODEL

KEY = "sk-sagemaker"


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_ping_is_health_and_needs_no_key(serve, http, method):
    url = await serve(api_key=KEY)
    async with http.request(method, f"{url}/ping") as r:
        assert r.status == 200 and await r.json() == {"status": "ok"}


async def test_invocations_runs_chat_and_completions_as_their_routes(base_url, http):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    completion = {"model": MODEL, "prompt": "Once", "max_tokens": 3, "temperature": 0}
    for body, path, kind in ((chat, "/v1/chat/completions", "chat.completion"),
                             (completion, "/v1/completions", "text_completion")):
        async with http.post(f"{base_url}/invocations", json=body) as r:
            via = await r.json()
        async with http.post(f"{base_url}{path}", json=body) as r:
            direct = await r.json()
        assert via["object"] == kind and via["choices"] == direct["choices"] and via["usage"] == direct["usage"]
    async with http.post(f"{base_url}/invocations", json={**chat, "stream": True}) as r:
        assert r.content_type == "text/event-stream" and (await r.text()).endswith("data: [DONE]\n\n")


async def test_invocations_runs_pooling_bodies_by_what_the_model_serves(engine, embedder, serve, http):
    url = await serve()
    async with http.post(f"{url}/invocations", json={"model": MODEL, "input": ["a", "b"]}) as r:
        body = await r.json()
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["embedding"] * 2
    engine.pooling = dict(pooling_tasks=["classify"], embedding_size=8, num_labels=1)
    url = await serve()
    for body, key in (({"input": "x"}, "label"), ({"text_1": "a", "text_2": ["b", "c"]}, "score"),
                      ({"query": "a", "documents": ["b", "c"]}, "relevance_score")):
        async with http.post(f"{url}/invocations", json={"model": MODEL, **body}) as r:
            reply = await r.json()
        assert key in (reply.get("data") or reply.get("results"))[0], reply


async def test_invocations_refuses_a_body_of_no_known_request(base_url, http):
    async with http.post(f"{base_url}/invocations", json={"model": MODEL, "text": "hi"}) as r:
        assert r.status == 400 and "`messages`" in (await r.json())["error"]["message"]
    async with http.post(f"{base_url}/invocations", json=["not", "an", "object"]) as r:
        assert r.status == 400
