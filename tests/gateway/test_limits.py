"""Hostile input: null content, requests past the message, character and fan-out limits, huge bodies,
slow bodies and idle sockets. Each gets a 4xx that names the limit (or a 200), and the event loop
keeps answering /health meanwhile."""
import asyncio
import json
import threading
import time

import grpc
import pytest

from pagedserve.gateway import params
from pagedserve.gateway.app import build_app
from pagedserve.gateway.schemas import MAX_MESSAGES
from pagedserve.gateway.server import start
from pagedserve.gateway.state import DEFAULT_MAX_CLIENT_BATCH_SIZE, GATEWAY
from tests.gateway.test_server import gateway_process

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = {"role": "user", "content": "hi"}
LIMIT = DEFAULT_MAX_CLIENT_BATCH_SIZE
# Each near the 4 MiB body limit.
HUGE = {
    "115k messages": (CHAT, {"messages": [USER] * 115_000}, f"length <= {MAX_MESSAGES}"),
    "4M characters": (CHAT, {"messages": [{"role": "user", "content": "a" * 4_000_000}]},
                      f"limit is {params.MAX_PROMPT_CHARS}"),
    "10,000 prompts": (COMPLETIONS, {"prompt": ["a"] * 10_000}, f"limit is {LIMIT}"),
    "2,000 prompts x n=16": (COMPLETIONS, {"prompt": ["a"] * 2_000, "n": 16}, f"limit is {LIMIT}"),
}


async def _post(http, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


async def test_content_may_be_null_on_assistant_messages_only(http, base_url):
    status, reply = await _post(http, base_url + CHAT, {"messages": [{"role": "user", "content": None}]})
    assert status == 400 and reply["error"]["param"] == "messages[0].content"
    assert "only assistant messages" in reply["error"]["message"]
    history = [USER, {"role": "assistant", "content": None}, USER]
    status, reply = await _post(http, base_url + CHAT, {"messages": history, "max_tokens": 2})
    assert status == 200, reply


@pytest.mark.parametrize("case", HUGE)
async def test_requests_past_a_limit_get_a_400_naming_it(http, base_url, engine, case):
    path, body, named = HUGE[case]
    status, reply = await _post(http, base_url + path, body)
    assert status == 400 and named in reply["error"]["message"]
    assert engine.requests == []


async def test_fan_out_up_to_the_limit_is_served(http, serve, engine):
    url = await serve(max_client_batch_size=8)
    status, reply = await _post(http, url + COMPLETIONS, {"prompt": ["a", "b"], "n": 4, "max_tokens": 1})
    assert status == 200 and len(reply["choices"]) == 8
    status, reply = await _post(http, url + COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1})
    assert status == 400 and "3 prompt(s) x n=3 = 9 completions; the limit is 8" in reply["error"]["message"]


async def test_large_inputs_are_tokenized_off_the_event_loop(http, base_url, monkeypatch):
    threads = []
    encode = params.encode_prompts
    monkeypatch.setattr(params, "encode_prompts", lambda *a: threads.append(threading.current_thread().name)
                        or encode(*a))
    await _post(http, base_url + COMPLETIONS, {"prompt": "a", "max_tokens": 1})
    await _post(http, base_url + COMPLETIONS, {"prompt": "a" * 100_000, "max_tokens": 1})
    assert threads[0] == threading.main_thread().name and threads[1].startswith("gateway-cpu")


async def test_health_answers_while_huge_requests_are_processed(http, engine, tokenizer_dir):
    """Each HUGE body, and one that is tokenized in full (then too long for the context), sent to a
    gateway process one after another under a /health poll: polls are answered all along. The bar
    is 100 ms, which the slowest poll meets on an idle machine (30-90 ms here); the bound asserted
    leaves room for a loaded 2-core box, where any process may wait that long for a core, and still
    catches a loop held for the whole tokenization (seconds)."""
    big = (CHAT, {"messages": [{"role": "user", "content": "The quick brown fox. " * 45_000}]},
           "maximum context length")
    cases = [*HUGE.values(), big]
    # Encoded up front: this process's event loop serves the fake engine that /health asks.
    bodies = [(path, json.dumps(body).encode()) for path, body, _ in cases]
    waits, done = [], asyncio.Event()

    async def poll(url: str) -> None:
        while not done.is_set():
            sent = time.monotonic()
            async with http.get(f"{url}/health") as r:
                assert r.status == 200
            waits.append(time.monotonic() - sent)
            await asyncio.sleep(0.01)

    async with gateway_process(http, engine, tokenizer_dir) as (url, _):
        polling = asyncio.create_task(poll(url))
        replies = []
        for path, body in bodies:
            async with http.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                replies.append((r.status, await r.json()))
        done.set()
        await polling
    for (status, reply), (_, _, named) in zip(replies, cases):
        assert status == 400 and named in reply["error"]["message"]
    assert len(waits) > 10 and max(waits) < 0.25, f"slowest /health: {max(waits):.3f} s"


async def _raw(url: str, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    return reader, writer


async def test_a_slow_body_gets_a_408(serve):
    url = await serve(body_read_timeout=0.3)
    reader, writer = await _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                     b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 408")
    body = await reader.read(2000)
    assert json.loads(body[body.index(b"{"):])["error"]["code"] == "request_timeout"
    writer.close()


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost:"], ids=["idle", "slow header"])
async def test_idle_and_slow_header_connections_are_closed(engine, tokenizer, sent):
    runner = await start(build_app(tokenizer, engine.address), "127.0.0.1", 0, timeout_keep_alive=0.3)
    try:
        host, port = runner.addresses[0][:2]
        reader, writer = await _raw(f"http://{host}:{port}", sent)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert runner.app[GATEWAY].drain.active == 0
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
async def test_scheduler_side_failures_are_503s_never_500s(http, base_url, engine, code):
    engine.reject = code
    async with http.post(base_url + COMPLETIONS, json={"prompt": "a", "max_tokens": 2}) as r:
        assert r.status == 503 and r.headers["Retry-After"]
        error = (await r.json())["error"]
    assert error["type"] == "service_unavailable"
    assert (error["code"] == "server_overloaded") == (code == grpc.StatusCode.RESOURCE_EXHAUSTED)


async def test_requests_past_max_concurrent_requests_get_a_503(http, serve, engine):
    """SEC-17: with --max-concurrent-requests 2, a third request while two stream is refused at
    once with 503 server_overloaded and Retry-After; once they end, requests are served again."""
    url = await serve(max_concurrent_requests=2)
    engine.delay = 0.02
    body = {"prompt": "hi", "max_tokens": 20, "stream": True}
    async with http.post(url + COMPLETIONS, json=body) as first, http.post(url + COMPLETIONS, json=body) as second:
        async with http.post(url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 1}) as third:
            assert third.status == 503 and third.headers["Retry-After"]
            error = (await third.json())["error"]
        async with http.get(url + "/load") as r:
            assert await r.json() == {"server_load": 2}
        assert error["code"] == "server_overloaded" and "--max-concurrent-requests" in error["message"]
        await first.read()
        await second.read()
    engine.delay = 0.001
    async with http.post(url + CHAT, json={"messages": [USER], "max_tokens": 1}) as r:
        assert r.status == 200
    async with http.get(url + "/load") as r:
        assert await r.json() == {"server_load": 0}
