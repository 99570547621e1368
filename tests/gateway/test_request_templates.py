"""SEC-1: a request's `chat_template` is refused unless the server trusts them; trusted, it renders in
the template worker under a deadline and a memory limit, and the sandbox refuses `*`, `**` and `+`
that would build huge values; the event loop keeps answering /health meanwhile."""
import asyncio
import time

import psutil
import pytest

from pagedserve.gateway import params

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
# 10^10 loop iterations: hours of CPU.
NESTED_LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
ECHO = "{% for m in messages %}[{{ m.content }}]{% endfor %}"


async def _post(http, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
async def test_a_request_template_is_refused_without_the_flag(http, base_url, engine, path):
    status, reply = await _post(http, base_url + path, {"messages": MSG, "chat_template": NESTED_LOOPS})
    assert status == 400 and reply["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in reply["error"]["message"]
    assert engine.requests == []


async def test_a_trusted_request_template_is_rendered(http, serve):
    url = await serve(trust_request_chat_template=True)
    status, reply = await _post(http, url + "/tokenize", {"messages": MSG, "chat_template": ECHO})
    assert status == 200
    status, text = await _post(http, url + "/detokenize", {"tokens": reply["tokens"]})
    assert text["prompt"] == "[hi]"


async def test_an_endless_template_ends_at_the_deadline_while_health_answers(http, serve, monkeypatch):
    from pagedserve.gateway import template_worker
    monkeypatch.setattr(template_worker, "RENDER_TIMEOUT_S", 0.5)
    url = await serve(trust_request_chat_template=True)
    # Started ahead, so that the child's start-up is not in the timed window.
    assert (await _post(http, url + "/tokenize", {"messages": MSG, "chat_template": ECHO}))[0] == 200
    waits, done = [], asyncio.Event()

    async def poll() -> None:
        while not done.is_set():
            sent = time.monotonic()
            async with http.get(url + "/health") as r:
                assert r.status == 200
            waits.append(time.monotonic() - sent)
            await asyncio.sleep(0.01)

    polling = asyncio.create_task(poll())
    started = time.monotonic()
    status, reply = await _post(http, url + CHAT, {"messages": MSG, "chat_template": NESTED_LOOPS})
    elapsed = time.monotonic() - started
    done.set()
    await polling
    assert status == 400 and reply["error"]["param"] == "chat_template"
    assert "did not finish within 0.5 s" in reply["error"]["message"]
    assert 0.5 <= elapsed < 2.0
    # The review's bar is 200 ms; an idle poll takes a few ms here.
    assert len(waits) > 5 and max(waits) < 0.2, f"slowest /health: {max(waits):.3f} s"
    # The worker was started again: the next trusted template renders.
    assert (await _post(http, url + "/tokenize", {"messages": MSG, "chat_template": ECHO}))[0] == 200


async def test_huge_values_are_refused_without_growing_the_gateway(http, serve):
    url = await serve(trust_request_chat_template=True)
    rss = psutil.Process().memory_info().rss
    for template in ("{{ 'x' * 10**9 }}", "{{ 9 ** (9 ** 9) }}", "{{ [1] * 10**8 }}",
                     "{% set s = 'x' * 1000000 %}{{ s + s + s }}"):
        status, reply = await _post(http, url + CHAT, {"messages": MSG, "chat_template": template})
        assert status == 400 and "would build a value" in reply["error"]["message"], template
    assert psutil.Process().memory_info().rss - rss < 100 * 2**20


async def test_a_template_past_the_memory_limit_is_a_400(http, serve):
    # str.ljust is not an operator the sandbox counts: the worker's address-space limit stops it.
    url = await serve(trust_request_chat_template=True)
    status, reply = await _post(http, url + CHAT, {"messages": MSG, "chat_template": "{{ 'x'.ljust(2**31) }}"})
    assert status == 400 and "MemoryError" in reply["error"]["message"]


async def test_a_template_past_the_size_limit_is_a_400(http, serve):
    url = await serve(trust_request_chat_template=True)
    template = "x" * (params.MAX_REQUEST_TEMPLATE_CHARS + 1)
    status, reply = await _post(http, url + CHAT, {"messages": MSG, "chat_template": template})
    assert status == 400 and reply["error"]["param"] == "chat_template"
    assert f"limit is {params.MAX_REQUEST_TEMPLATE_CHARS}" in reply["error"]["message"]


async def test_tools_and_kwargs_count_toward_the_character_limit(http, base_url):
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 600_000}}
    body = {"messages": MSG, "tools": [tool], "tool_choice": "none", "chat_template_kwargs": {"x": "y" * 600_000}}
    status, reply = await _post(http, base_url + CHAT, body)
    assert status == 400 and f"limit is {params.MAX_PROMPT_CHARS}" in reply["error"]["message"]


async def test_a_chat_large_only_in_its_tools_renders_off_the_event_loop(http, base_url, monkeypatch):
    import threading

    from pagedserve.common.tokenizer import Tokenizer
    threads = []
    render_chat = Tokenizer.render_chat
    monkeypatch.setattr(Tokenizer, "render_chat", lambda *a: threads.append(threading.current_thread().name)
                        or render_chat(*a))
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 100_000}}
    await _post(http, base_url + "/tokenize", {"messages": MSG, "tools": [tool]})
    assert threads == [threads[0]] and threads[0].startswith("gateway-cpu")


def test_the_sandbox_bounds_operators_and_output():
    from pagedserve.common.chat_template import ChatTemplateError, compile_template, render
    with pytest.raises(ChatTemplateError, match="would build a value"):
        render(compile_template("{{ 'ab' * 2000000 }}"), {})
    with pytest.raises(ChatTemplateError, match="wrote more than"):
        render(compile_template("{% for i in range(3) %}{{ s }}{% endfor %}"), {"s": "x" * 1_000_000})
    # What real templates do with the operators still works.
    assert render(compile_template("{{ '-' * 3 }}{{ 2 ** 10 }}{{ [1] + [2] }}{{ 'a' + 'b' }}"), {}) == "---1024[1, 2]ab"
