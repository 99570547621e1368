"""/v1/messages and /v1/messages/count_tokens on the fake engine, through the anthropic SDK and raw:
the same text and usage as chat, streamed or not; tool_use, thinking and stop_sequence; errors in
Anthropic's shape, never a 500."""
import json

import anthropic
import openai
import pytest

from pagedserve.gateway.errors import MAX_BODY_BYTES
from tests.gateway.fake_engine import MODEL, REPLY

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"city": "Paris"}
TOOLS = [{"name": "get_weather", "description": "The weather.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
HERMES_CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}\n</tool_call>'


def anthropic_client(url: str, **options) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(**{"base_url": url, "api_key": "EMPTY", "max_retries": 0, **options})


async def chat_reply(url: str, max_tokens: int) -> tuple[str, openai.types.CompletionUsage]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0) as client:
        reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens)
    return reply.choices[0].message.content, reply.usage


async def raw_events(http, url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a streamed /v1/messages."""
    async with http.post(f"{url}/v1/messages", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        frames = (await r.text()).split("\n\n")
    assert frames[-1] == ""
    events = []
    for frame in frames[:-1]:
        name, data = frame.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def test_create_and_stream_say_what_chat_says(base_url):
    text, usage = await chat_reply(base_url, 12)
    async with anthropic_client(base_url) as client:
        whole = await client.messages.create(model=MODEL, max_tokens=12, messages=MESSAGES)
        async with client.messages.stream(model=MODEL, max_tokens=12, messages=MESSAGES) as stream:
            streamed = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == streamed == text
    assert final.content[0].text == text and REPLY.startswith(text)
    for message in (whole, final):
        assert message.stop_reason == "max_tokens" and message.role == "assistant" and message.model == MODEL
        assert (message.usage.input_tokens, message.usage.output_tokens) == (usage.prompt_tokens,
                                                                              usage.completion_tokens)
    assert whole.id.startswith("msg_") and whole.id != final.id


async def test_stream_events_in_anthropic_order(http, base_url):
    events = await raw_events(http, base_url, {"max_tokens": 5, "messages": MESSAGES})
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5 and delta["usage"]["input_tokens"] == start["usage"]["input_tokens"]


async def test_a_stop_sequence_is_named(base_url):
    async with anthropic_client(base_url) as client:
        whole = await client.messages.create(model=MODEL, max_tokens=40, messages=MESSAGES, stop_sequences=["fox"])
        async with client.messages.stream(model=MODEL, max_tokens=40, messages=MESSAGES,
                                          stop_sequences=["fox"]) as stream:
            final = await stream.get_final_message()
    for message in (whole, final):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "fox")
        assert message.content[0].text == REPLY[:REPLY.index("fox")]


async def test_tool_use_whole_and_streamed_then_the_result_goes_back(serve, engine, tokenizer):
    url = await serve(tool_parser="hermes")
    engine.reply = tokenizer.encode(HERMES_CALL, add_special_tokens=False) + [engine.eos]
    async with anthropic_client(url) as client:
        whole = await client.messages.create(model=MODEL, max_tokens=len(engine.reply), messages=MESSAGES,
                                             tools=TOOLS)
        async with client.messages.stream(model=MODEL, max_tokens=len(engine.reply), messages=MESSAGES,
                                          tools=TOOLS) as stream:
            final = await stream.get_final_message()
        for message in (whole, final):
            [call] = message.content
            assert (call.type, call.name, call.input) == ("tool_use", "get_weather", WEATHER)
            assert message.stop_reason == "tool_use"
        history = [*MESSAGES, {"role": "assistant", "content": whole.content},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": whole.content[0].id,
                                                 "content": "21C"}]}]
        engine.reply = tokenizer.encode("Sunny.", add_special_tokens=False) + [engine.eos]
        answer = await client.messages.create(model=MODEL, max_tokens=20, messages=history, tools=TOOLS)
    assert answer.content[0].text == "Sunny." and answer.stop_reason == "end_turn"
    prompt = tokenizer.decode(list(engine.requests[-1].prompt_token_ids))
    assert "<|tool|>21C" in prompt


async def test_tool_use_streams_its_input_as_json_deltas(http, serve, engine, tokenizer):
    url = await serve(tool_parser="hermes")
    engine.reply = tokenizer.encode(HERMES_CALL, add_special_tokens=False) + [engine.eos]
    events = await raw_events(http, url, {"max_tokens": len(engine.reply), "messages": MESSAGES, "tools": TOOLS,
                                          "tool_choice": {"type": "auto"}})
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert [(b["type"], b["name"], b["input"]) for b in starts] == [("tool_use", "get_weather", {})]
    fragments = [data["delta"]["partial_json"] for name, data in events if name == "content_block_delta"]
    assert json.loads("".join(fragments)) == WEATHER
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_thinking_blocks_with_a_reasoning_parser(serve, engine, tokenizer):
    url = await serve(reasoning_parser="qwen3")
    engine.reply = tokenizer.encode("<think>Plan it.</think>The answer.", add_special_tokens=False)
    body = dict(model=MODEL, max_tokens=len(engine.reply), messages=MESSAGES,
                thinking={"type": "enabled", "budget_tokens": 1024})
    async with anthropic_client(url) as client:
        whole = await client.messages.create(**body)
        async with client.messages.stream(**body) as stream:
            final = await stream.get_final_message()
    for message in (whole, final):
        assert [(b.type, getattr(b, "thinking", None) or b.text) for b in message.content] == [
            ("thinking", "Plan it."), ("text", "The answer.")]


async def test_a_prefilled_assistant_turn_is_continued(http, base_url, engine, tokenizer):
    prefilled = [*MESSAGES, {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}]
    async with anthropic_client(base_url) as client:
        message = await client.messages.create(model=MODEL, max_tokens=3, messages=prefilled)
        counted = await client.messages.count_tokens(model=MODEL, messages=prefilled)
    prompt = list(engine.requests[-1].prompt_token_ids)
    assert tokenizer.decode(prompt, False).endswith("<|assistant|>The answer is")
    assert counted.input_tokens == len(prompt) == message.usage.input_tokens
    # The reply is the continuation alone, as Anthropic's.
    expected = tokenizer.decode(tokenizer.encode(REPLY, add_special_tokens=False)[:3]).rstrip("\ufffd")
    assert message.content[0].text == expected


async def test_count_tokens_is_chat_prompt_length(base_url):
    _, usage = await chat_reply(base_url, 1)
    async with anthropic_client(base_url) as client:
        counted = await client.messages.count_tokens(model=MODEL, messages=MESSAGES)
        with_system = await client.messages.count_tokens(model=MODEL, messages=MESSAGES, system="Be brief.")
    assert counted.input_tokens == usage.prompt_tokens < with_system.input_tokens


def too_long_chat() -> list[dict]:
    return [{"role": "user", "content": "hello world " * 200}]


@pytest.mark.parametrize("body, status, kind", [
    ({"messages": MESSAGES}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MESSAGES, "model": "claude-opus-4"}, 404, "not_found_error"),
    ({"max_tokens": 5, "messages": too_long_chat()}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MESSAGES, "stop_sequences": ["x" * 1_000_000]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "any"}}, 200, None),
    ({"max_tokens": 5, "messages": [*MESSAGES, {"role": "assistant", "content": "The answer is "}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 5, "messages": [*MESSAGES, {"role": "assistant", "content": "The answer is"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [*MESSAGES, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [*MESSAGES, {"role": "assistant", "content": []}]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MESSAGES, "tools": TOOLS}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MESSAGES, "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS},
     400, "invalid_request_error"),
])
async def test_bad_requests_get_anthropic_errors(http, base_url, body, status, kind):
    async with http.post(f"{base_url}/v1/messages", json={"model": MODEL, **body}) as r:
        assert r.status == status, await r.text()
        if kind is not None:
            assert await r.json() == {"type": "error", "error": {"type": kind, "message": (await r.json())["error"][
                "message"]}}


@pytest.mark.parametrize("method, path, data, headers, status, kind", [
    ("POST", "/v1/messages", b"{not json", {"Content-Type": "application/json"}, 400, "invalid_request_error"),
    ("POST", "/v1/messages", b"{}", {"Content-Type": "text/plain"}, 400, "invalid_request_error"),
    ("POST", "/v1/messages", b"x" * (MAX_BODY_BYTES + 1), {"Content-Type": "application/json"}, 413,
     "request_too_large"),
    ("GET", "/v1/messages", None, {}, 405, "invalid_request_error"),
    ("POST", "/v1/messages/count_tokens", b'{"messages": []}', {"Content-Type": "application/json"}, 400,
     "invalid_request_error"),
])
async def test_malformed_http_gets_anthropic_errors(http, base_url, method, path, data, headers, status, kind):
    async with http.request(method, base_url + path, data=data, headers=headers) as r:
        assert r.status == status
        body = await r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]


async def test_the_sdk_raises_its_own_errors(serve):
    url = await serve(api_key="sk-key")
    async with anthropic_client(url, api_key="wrong") as client:
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES)
    async with anthropic_client(url, api_key="sk-key") as client:
        reply = await client.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES)
        assert reply.content[0].text
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="claude-opus-4", max_tokens=2, messages=MESSAGES)
    async with anthropic_client(url, api_key=None, auth_token="sk-key") as client:
        assert (await client.messages.count_tokens(model=MODEL, messages=MESSAGES)).input_tokens


async def test_a_failure_mid_stream_is_an_error_event(http, base_url, engine):
    engine.fail_after = 3
    events = await raw_events(http, base_url, {"max_tokens": 10, "messages": MESSAGES})
    name, data = events[-1]
    assert name == "error" and data["type"] == "error" and data["error"]["type"] == "api_error"
    assert "/secret" not in data["error"]["message"]


async def test_sampling_fields_and_output_config_reach_the_engine(base_url, engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    async with anthropic_client(base_url) as client:
        await client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES, stop_sequences=["zzz"],
                                     output_config={"format": {"type": "json_schema", "schema": schema}},
                                     extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20})
    p = engine.requests[-1].params
    assert (p.max_tokens, p.top_k) == (4, 20) and json.loads(p.structured_outputs.json) == schema
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.9)
