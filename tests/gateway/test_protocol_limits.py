"""The limits chat has, on /v1/messages and the Ollama routes: --max-concurrent-requests, the shutdown
drain and a scheduler that sheds load answer 503 in each protocol's shape; a 100k-character tool
argument streams through each protocol whole and fast."""
import asyncio
import json
import time

import grpc
import pytest

from pagedserve.gateway.state import GATEWAY
from tests.gateway.fake_engine import MODEL, serve_gateway
from tests.gateway.test_metrics import scrape
from tests.gateway.test_hostile_requests import ARGUMENT, TOOL_CALL

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
# Each generation route's path, a body that streams `n` tokens, and how its 503 reads.
ROUTES = {
    "messages": ("/v1/messages", lambda n: {"model": MODEL, "max_tokens": n, "stream": True, "messages": USER},
                 lambda body: body["type"] == "error" and body["error"]["type"] == "overloaded_error"),
    "ollama chat": ("/api/chat", lambda n: {"model": MODEL, "messages": USER, "options": {"num_predict": n}},
                    lambda body: list(body) == ["error"]),
    "ollama generate": ("/api/generate", lambda n: {"model": MODEL, "prompt": "hi", "options": {"num_predict": n}},
                        lambda body: list(body) == ["error"]),
}


@pytest.mark.parametrize("route", ROUTES)
async def test_past_max_concurrent_requests_a_503_in_the_protocols_shape(http, serve, engine, route):
    path, body, overloaded = ROUTES[route]
    url = await serve(max_concurrent_requests=1)
    engine.delay = 0.02
    async with http.post(url + path, json=body(20)) as first:
        async with http.post(url + path, json=body(1)) as second:
            assert second.status == 503 and second.headers["Retry-After"]
            refusal = await second.json()
        await first.read()
    assert overloaded(refusal) and "--max-concurrent-requests" in json.dumps(refusal)
    engine.delay = 0.001
    async with http.post(url + path, json=body(1)) as r:
        assert r.status == 200


@pytest.mark.parametrize("route", ROUTES)
async def test_a_scheduler_shedding_load_is_a_503(http, base_url, engine, route):
    path, body, overloaded = ROUTES[route]
    engine.reject = grpc.StatusCode.RESOURCE_EXHAUSTED
    async with http.post(base_url + path, json=body(2)) as r:
        assert r.status == 503 and overloaded(await r.json())


async def test_while_draining_new_requests_get_a_503_in_the_protocols_shape(http, engine, tokenizer):
    runner, url = await serve_gateway(tokenizer, engine.address)
    engine.delay = 0.05
    try:
        running = await http.post(url + "/api/chat", json=ROUTES["ollama chat"][1](200))
        await running.content.readline()
        draining = asyncio.create_task(runner.app[GATEWAY].drain.drain(timeout=0.5))
        await asyncio.sleep(0.05)
        for path, body, overloaded in ROUTES.values():
            async with http.post(url + path, json=body(1)) as r:
                assert r.status == 503 and overloaded(await r.json()) and "shutting down" in await r.text()
        last = json.loads((await running.read()).splitlines()[-1])
        assert list(last) == ["error"] and "shutting down" in last["error"]
        running.release()
        await asyncio.wait_for(draining, 5)
    finally:
        await runner.cleanup()


async def _streamed_arguments(http, url: str, path: str, body: dict) -> str:
    async with http.post(url + path, json=body) as r:
        assert r.status == 200
        text = await r.text()
    if path == "/api/chat":
        calls = [c for line in text.splitlines() for c in json.loads(line)["message"].get("tool_calls", ())]
        return json.dumps(calls[0]["function"]["arguments"])
    events = [json.loads(frame.split("\ndata: ")[1]) for frame in text.split("\n\n")[:-1]]
    return "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", lambda n: {"max_tokens": n, "stream": True, "messages": USER,
                                "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
    ("/api/chat", lambda n: {"messages": USER, "tools": TOOLS, "options": {"num_predict": n}}),
])
async def test_a_100k_character_tool_argument_streams_whole(http, serve, engine, tokenizer, path, body):
    url = await serve(tool_parser="hermes")
    engine.reply = tokenizer.encode(TOOL_CALL, add_special_tokens=False) + [engine.eos]
    engine.tokens_per_reply, engine.max_model_len = 128, 200_000
    started = time.monotonic()
    arguments = await _streamed_arguments(http, url, path, {"model": MODEL, **body(len(engine.reply))})
    assert json.loads(arguments) == {"text": ARGUMENT} and time.monotonic() - started < 5


async def test_requests_are_counted_by_route(http, base_url):
    for path, body, _ in ROUTES.values():
        async with http.post(base_url + path, json=body(1)) as r:
            assert r.status == 200
    async with http.post(f"{base_url}/v1/messages", json={"model": MODEL}) as r:
        assert r.status == 400
    async with http.get(f"{base_url}/api/nowhere") as r:
        assert r.status == 404
    m = await scrape(http, base_url)

    def count(handler: str, method: str, status: str) -> float:
        return m[("pagedserve:http_requests_total", (("handler", handler), ("method", method), ("status", status)))]

    assert [count(path, "POST", "2xx") for path, _, _ in ROUTES.values()] == [1, 1, 1]
    assert count("/v1/messages", "POST", "4xx") == 1 and count("unmatched", "GET", "4xx") == 1
