"""Issue 26's bar: five hostile requests sent at once to a gateway process — a template that loops
without end, a 150k-entry logit_bias, a 1 MB stop string, a 100k-character streamed tool argument
and a 4 MB regex — each get a 400 or complete within their caps, while /health keeps answering."""
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator

from tests.gateway.test_server import gateway_process

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
ARGUMENT = "The quick brown fox jumps over the lazy dog. " * 2300
TOOL_CALL = f'<tool_call>\n{{"name": "f", "arguments": {{"text": "{ARGUMENT}"}}}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
HOSTILE = {
    "endless template": (CHAT, {"messages": MSG, "chat_template": NESTED_LOOPS}, "chat_template"),
    "150k-entry logit_bias": (COMPLETIONS, {"prompt": "hi", "logit_bias": {str(t): 1 for t in range(150_000)}},
                              "logit_bias"),
    "1 MB stop string": (COMPLETIONS, {"prompt": "hi", "stop": "x" * 1_000_000}, "stop"),
    "4 MB regex": (COMPLETIONS, {"prompt": "hi", "guided_regex": "x" * 4_000_000}, "guided_regex"),
}


async def _refused(http, url: str, path: str, body: bytes) -> tuple[int, str | None]:
    async with http.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
        return r.status, (await r.json())["error"]["param"]


async def _tool_call_stream(http, url: str, tokens: int) -> tuple[str, float]:
    """Streams the fake engine's 100k-character tool call (`tokens` long); returns its arguments and
    how long it took."""
    body = {"messages": MSG, "tools": TOOLS, "stream": True, "max_tokens": tokens}
    started, arguments = time.monotonic(), []
    async with http.post(url + CHAT, json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    arguments += [c["function"].get("arguments") or "" for c in choice["delta"].get("tool_calls") or ()]
    return "".join(arguments), time.monotonic() - started


# Calls /health until its stdin closes, then prints each call's seconds as JSON. A process of its
# own: a thread of the test's would wait for the GIL that the fake engine and the streams' parsing
# hold, and count that wait as the gateway's.
POLL_HEALTH = """
import json, select, sys, time, urllib.request
waits = []
while not select.select([sys.stdin], [], [], 0)[0]:
    sent = time.monotonic()
    with urllib.request.urlopen(sys.argv[1] + "/health", timeout=5) as r:
        assert r.status == 200
    waits.append(time.monotonic() - sent)
    time.sleep(0.01)
print(json.dumps(waits))
"""


@contextlib.asynccontextmanager
async def health_polled(url: str) -> AsyncIterator[list[float]]:
    """Polls url's /health (POLL_HEALTH) while the block runs; the list then holds each poll's seconds."""
    poller = await asyncio.create_subprocess_exec(sys.executable, "-c", POLL_HEALTH, url,
                                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    waits: list[float] = []
    try:
        yield waits
    finally:
        waits += json.loads((await poller.communicate(b"done"))[0])


async def test_hostile_requests_are_refused_or_bounded_while_health_answers(http, engine, tokenizer, tokenizer_dir):
    # The fake engine writes the tool call 128 tokens per message (about 600 deltas); its context
    # holds it.
    engine.reply = tokenizer.encode(TOOL_CALL, add_special_tokens=False)
    engine.tokens_per_reply, engine.delay, engine.max_model_len = 128, 0.001, 200_000
    # Encoded up front: this process's event loop also serves the fake engine.
    bodies = {name: (path, json.dumps(body).encode(), param) for name, (path, body, param) in HOSTILE.items()}
    async with gateway_process(http, engine, tokenizer_dir, "--trust-request-chat-template",
                               "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as (url, _):
        async with health_polled(url) as waits:
            *refusals, (arguments, streamed_s) = await asyncio.gather(
                *(_refused(http, url, path, body) for path, body, _ in bodies.values()),
                _tool_call_stream(http, url, len(engine.reply)))
    assert refusals == [(400, param) for _, _, param in bodies.values()]
    assert json.loads(arguments) == {"text": ARGUMENT} and streamed_s < 5
    # The bar is 100 ms. On the 2-core machine, with the endless template's worker spinning (at
    # nice 10) and the five at once, the slowest poll took 36-74 ms in six runs at load average 3;
    # at load average 6-7 from other jobs, one poll in 150 passed 100 ms (104-151 ms) in 3 runs of
    # 12. The gateway's own longest hold of its event loop is 10-18 ms (asyncio's debug mode,
    # in-process); the rest is waiting for a core.
    assert len(waits) > 20 and max(waits) < 0.1, f"slowest /health: {max(waits) * 1000:.0f} ms"
