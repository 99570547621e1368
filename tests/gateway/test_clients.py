"""Real client libraries against the gateway: LangChain's ChatOpenAI and a Dify-style raw HTTP flow."""
import json

from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI

from tests.gateway.fake_engine import MODEL, REPLY

PING = [{"role": "user", "content": "ping"}]


def _chat(base_url: str, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", model=MODEL, max_retries=0, **kwargs)


async def test_langchain_invoke_honours_max_tokens(base_url, engine):
    reply = await _chat(base_url, max_tokens=6, temperature=0).ainvoke("Say hello")
    assert REPLY.startswith(reply.content) and reply.content
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.usage_metadata["output_tokens"] == 6
    assert engine.requests[-1].params.max_tokens == 6


async def test_langchain_stream_equals_invoke(base_url):
    chat = _chat(base_url, max_tokens=12, temperature=0)
    whole = await chat.ainvoke("Say hello")
    chunks = [c async for c in chat.astream("Say hello")]
    assert "".join(c.content for c in chunks) == whole.content
    assert all(c.usage_metadata is None for c in chunks)


async def test_langchain_stream_usage(base_url):
    chat = _chat(base_url, max_tokens=8, stream_usage=True)
    total = None
    async for chunk in chat.astream("Say hello"):
        assert isinstance(chunk, AIMessageChunk)
        total = chunk if total is None else total + chunk
    assert total.usage_metadata["output_tokens"] == 8
    assert total.usage_metadata["input_tokens"] > 0
    assert total.usage_metadata["total_tokens"] == total.usage_metadata["input_tokens"] + 8


async def test_dify_credential_check_then_stream(http, base_url):
    async with http.get(f"{base_url}/v1/models") as r:
        assert MODEL in [m["id"] for m in (await r.json())["data"]]
    check = {"model": MODEL, "max_tokens": 5, "messages": PING}
    async with http.post(f"{base_url}/v1/chat/completions", json=check,
                         headers={"Authorization": "Bearer EMPTY"}) as r:
        assert r.status == 200
        assert (await r.json())["object"] == "chat.completion"
    body = {"model": MODEL, "messages": PING, "max_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(f"{base_url}/v1/chat/completions", json=body) as r:
        raw = (await r.read()).decode()
    text, usage = "", None
    # Dify's parser: split on blank lines, strip "data:", stop at the first payload that is not JSON.
    for event in raw.split("\n\n"):
        payload = event.strip().removeprefix("data:").strip()
        if not payload:
            continue
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            assert payload == "[DONE]"
            break
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text += delta.get("reasoning_content") or delta.get("content") or ""
        usage = chunk.get("usage") or usage
    assert REPLY.startswith(text) and text
    assert usage["completion_tokens"] == 20
