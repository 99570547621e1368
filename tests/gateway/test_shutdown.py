"""Graceful shutdown of the gateway: /health and new requests 503 at once, running requests go on
until the timeout, then streams end with an error event and [DONE] and the rest with a 503."""
import asyncio
import json

import pytest

from pagedserve.gateway.state import GATEWAY
from tests.gateway.fake_engine import serve_live_gateway

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}


@pytest.fixture
async def gateway(engine, tokenizer):
    runner, url = await serve_live_gateway(tokenizer, engine.address)
    yield url, runner.app[GATEWAY].drain
    await runner.cleanup()


async def _events(response) -> list[str]:
    return (await response.read()).decode().split("\n\n")[:-1]


async def test_requests_that_finish_in_time_complete(http, engine, gateway):
    url, drain = gateway
    engine.delay = 0.02
    async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 10, "stream": True}) as r:
        await r.content.readuntil(b"\n\n")
        draining = asyncio.create_task(drain.drain(timeout=30))
        events = await _events(r)
    await asyncio.wait_for(draining, 5)
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]


async def test_timeout_ends_streams_with_an_error_and_done(http, engine, gateway):
    url, drain = gateway
    engine.delay = 0.05
    streams = [await http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}) for _ in range(3)]
    whole = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=CHAT))
    for r in streams:
        await r.content.readuntil(b"\n\n")
    while len(engine.requests) < 4:
        await asyncio.sleep(0.01)
    draining = asyncio.create_task(drain.drain(timeout=0.5))
    await asyncio.sleep(0.05)
    async with http.get(f"{url}/health") as r:
        assert r.status == 503 and r.headers["Retry-After"]
    async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503 and (await r.json())["error"]["type"] == "service_unavailable"
    async with http.get(f"{url}/metrics") as r:
        assert r.status == 200
    for r in streams:
        events = await _events(r)
        assert events[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(events[-2].removeprefix("data: "))["error"]["message"]
        r.release()
    async with await whole as r:
        assert r.status == 503 and "shutting down" in (await r.json())["error"]["message"]
    await asyncio.wait_for(draining, 5)
    await engine.wait_cancelled(count=4)
    assert len(engine.cancelled) == 4
