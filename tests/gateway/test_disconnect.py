"""A client that goes away cancels its engine call promptly, streaming or not."""
import asyncio
import json
import time

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}


async def _send(base_url: str, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    await writer.drain()
    return reader, writer


async def _disconnect_and_time(engine, writer) -> float:
    assert not engine.cancelled
    closed = time.monotonic()
    writer.close()
    await engine.wait_cancelled()
    assert engine.cancelled, "the engine call was not cancelled"
    return next(iter(engine.cancelled.values())) - closed


async def test_disconnect_mid_stream(engine, base_url):
    engine.delay = 0.05
    reader, writer = await _send(base_url, {**CHAT, "stream": True})
    await reader.readuntil(b"data: ")
    await reader.readuntil(b"data: ")
    assert await _disconnect_and_time(engine, writer) < 1.0


async def test_disconnect_during_non_stream_request(engine, base_url):
    engine.delay = 0.05
    _, writer = await _send(base_url, CHAT)
    while not engine.requests:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert await _disconnect_and_time(engine, writer) < 1.0


async def test_disconnect_before_first_token(engine, base_url):
    engine.delay = 0.5
    _, writer = await _send(base_url, {**CHAT, "stream": True})
    while not engine.requests:
        await asyncio.sleep(0.01)
    assert await _disconnect_and_time(engine, writer) < 1.0
