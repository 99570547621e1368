"""/v1/responses on the fake engine: bodies, stream events and input item lists that OpenAI's own
schemas accept; the stream helper's view equal to the body; reasoning and function_call items;
the bounded store; and the limits and errors chat has, in OpenAI's shape."""
import asyncio
import json
import time

import grpc
import openai
import pytest

from pagedserve.common.tokenizer import Tokenizer
from pagedserve.gateway.response_store import ResponseStore, StoredResponse
from pagedserve.gateway.state import GATEWAY
from pagedserve.gateway.responses_api import chat_messages
from pagedserve.gateway.responses_schemas import InputItem, Part, Response, TextOptions
from tests.gateway.fake_engine import CHAT_TEMPLATE, MODEL, serve_live_gateway
from tests.gateway.test_openapi_shapes import validate  # noqa: F401 (a fixture)

RESPONSES = "/v1/responses"
# Each stream event's schema in OpenAI's spec, by its type.
EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent", "response.in_progress": "ResponseInProgressEvent",
    "response.completed": "ResponseCompletedEvent", "response.incomplete": "ResponseIncompleteEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent", "response.output_text.done": "ResponseTextDoneEvent",
    "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
    "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "error": "ResponseErrorEvent"}
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def reply(engine, tokenizer, text: str) -> None:
    """Makes the fake engine answer `text`, then end."""
    engine.reply = tokenizer.encode(text, add_special_tokens=False) + [engine.eos]


def sse(raw: str) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a named stream, which has no [DONE]."""
    events = []
    for block in raw.strip("\n").split("\n\n"):
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def post(http, url: str, body: dict) -> tuple[int, str]:
    async with http.post(url + RESPONSES, json={"model": MODEL, **body}) as r:
        return r.status, await r.text()


async def test_body_stream_and_items_fit_openai_schemas(http, base_url, engine, tokenizer, validate):
    reply(engine, tokenizer, "Hello there.")
    status, body = await post(http, base_url, {"input": "hi", "instructions": "Be brief.", "metadata": {"k": "v"}})
    assert status == 200
    made = json.loads(body)
    validate("Response", made)
    assert made["output"][0]["content"][0]["text"] == "Hello there." and made["metadata"] == {"k": "v"}
    assert made["status"] == "completed" and made["usage"]["output_tokens"] == 5
    status, raw = await post(http, base_url, {"input": "hi", "instructions": "Be brief.", "stream": True})
    events = sse(raw)
    for name, data in events:
        assert name == data["type"]
        validate(EVENT_SCHEMAS[name], data)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "Hello there."
    assert events[-1][1]["response"]["output"][0]["content"] == made["output"][0]["content"]
    async with http.get(f"{base_url}{RESPONSES}/{made['id']}/input_items") as r:
        validate("ResponseItemList", await r.json())


async def test_prompt_holds_instructions_then_history_then_the_turn(http, base_url, engine, tokenizer):
    reply(engine, tokenizer, "Hi.")
    _, first = await post(http, base_url, {"input": "one", "instructions": "Old."})
    await post(http, base_url, {"input": "two", "instructions": "New.", "previous_response_id": json.loads(first)["id"]})
    prompt = tokenizer.decode(list(engine.requests[-1].prompt_token_ids))
    assert prompt == "<|system|>New.\n<|user|>one\n<|assistant|>Hi.\n<|user|>two\n<|assistant|>"


async def test_reasoning_effort_reaches_the_template(http, engine, tokenizer_dir):
    template = "{{ reasoning_effort }}|" + CHAT_TEMPLATE
    tokenizer = Tokenizer.from_dir(tokenizer_dir, chat_template=template)
    runner, url = await serve_live_gateway(tokenizer, engine.address)
    try:
        await post(http, url, {"input": "hi", "reasoning": {"effort": "low"}, "max_output_tokens": 1})
    finally:
        await runner.cleanup()
    assert tokenizer.decode(list(engine.requests[-1].prompt_token_ids)).startswith("low|")


async def test_reasoning_and_function_call_items_stream_as_the_body_holds_them(http, serve, engine, tokenizer,
                                                                                validate):
    url = await serve(reasoning_parser="deepseek_r1")
    reply(engine, tokenizer, '<think>plan</think>{"city": "Dallas"}')
    named = {"type": "function", "name": "get_weather"}
    body = {"input": "weather?", "tools": [TOOL], "tool_choice": named}
    made = json.loads((await post(http, url, body))[1])
    validate("Response", made)
    assert [item["type"] for item in made["output"]] == ["reasoning", "function_call"]
    assert made["output"][0]["content"] == [{"type": "reasoning_text", "text": "plan"}]
    call = made["output"][1]
    assert call["name"] == "get_weather" and call["arguments"] == '{"city": "Dallas"}' and call["call_id"]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    async with client.responses.stream(model=MODEL, **body) as stream:
        names = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[1].arguments == call["arguments"] and final.output[0].content[0].text == "plan"
    assert "response.reasoning_text.delta" in names and "response.function_call_arguments.done" in names
    for name, data in sse((await post(http, url, {**body, "stream": True}))[1]):
        validate(EVENT_SCHEMAS[name], data)


async def test_a_length_finish_is_incomplete(http, base_url):
    made = json.loads((await post(http, base_url, {"input": "hi", "max_output_tokens": 3}))[1])
    assert made["status"] == "incomplete" and made["incomplete_details"] == {"reason": "max_output_tokens"}
    _, raw = await post(http, base_url, {"input": "hi", "max_output_tokens": 3, "stream": True})
    assert sse(raw)[-1][0] == "response.incomplete"


async def test_a_failure_mid_stream_ends_it_with_an_error_event(http, base_url, engine, validate):
    engine.fail_after = 3
    _, raw = await post(http, base_url, {"input": "hi", "max_output_tokens": 10, "stream": True})
    name, data = sse(raw)[-1]
    assert name == "error" and data["message"] and "/secret" not in raw
    validate(EVENT_SCHEMAS[name], data)


async def test_input_items_page_and_delete(http, base_url, engine, tokenizer):
    reply(engine, tokenizer, "ok")
    items = [{"role": "user", "content": f"m{i}"} for i in range(3)]
    made = json.loads((await post(http, base_url, {"input": items}))[1])
    listing = f"{base_url}{RESPONSES}/{made['id']}/input_items"
    async with http.get(listing, params={"order": "asc", "limit": "2"}) as r:
        page = await r.json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["m0", "m1"] and page["has_more"]
    async with http.get(listing, params={"order": "asc", "after": page["last_id"]}) as r:
        assert [i["content"][0]["text"] for i in (await r.json())["data"]] == ["m2"]
    async with http.get(listing) as r:
        assert [i["content"][0]["text"] for i in (await r.json())["data"]] == ["m2", "m1", "m0"]
    async with http.delete(f"{base_url}{RESPONSES}/{made['id']}") as r:
        assert (await r.json()) == {"id": made["id"], "object": "response", "deleted": True}
    async with http.get(listing) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"


async def test_store_false_keeps_nothing(http, base_url):
    made = json.loads((await post(http, base_url, {"input": "hi", "max_output_tokens": 2, "store": False}))[1])
    async with http.get(f"{base_url}{RESPONSES}/{made['id']}") as r:
        assert r.status == 404


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "tools": [{"type": "file_search"}, {"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": {"type": "web_search"}, "tools": [TOOL]}, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"input": [{"type": "message", "content": "no role"}]}, "input[0].role"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "hi", "truncation": "middle"}, "truncation"),
    ({"input": "hi", "background": True, "stream": True}, "background"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "max_output_tokens": 1000}, "max_output_tokens"),
    ({"input": "hi", "model": "other"}, "model"),
    ({"input": "x" * 1_100_000}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": "a"}] * 3000}, "input"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"input": "hi", "top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"input": "hi", "top_logprobs": -1}, "top_logprobs"),
])
async def test_bad_input_gets_an_openai_error_never_a_500(http, base_url, engine, body, param):
    status, raw = await post(http, base_url, body)
    assert 400 <= status < 500, raw
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    assert engine.requests == []


async def test_past_max_concurrent_requests_responses_get_a_503(http, serve, engine):
    url = await serve(max_concurrent_requests=1)
    engine.delay = 0.02
    async with http.post(url + RESPONSES, json={"input": "hi", "max_output_tokens": 20, "stream": True}) as first:
        status, raw = await post(http, url, {"input": "hi", "max_output_tokens": 1})
        assert status == 503 and json.loads(raw)["error"]["code"] == "server_overloaded"
        await first.read()


async def test_a_scheduler_that_sheds_load_gets_a_503(http, base_url, engine):
    engine.reject = grpc.StatusCode.RESOURCE_EXHAUSTED
    status, raw = await post(http, base_url, {"input": "hi", "max_output_tokens": 2, "stream": True})
    assert status == 503 and json.loads(raw)["error"]["code"] == "server_overloaded"


async def _get(http, url: str, response_id: str) -> dict:
    async with http.get(f"{url}{RESPONSES}/{response_id}") as r:
        return await r.json()


async def test_a_background_response_is_made_after_the_answer(http, base_url, engine, tokenizer):
    reply(engine, tokenizer, "Hello there.")
    engine.delay = 0.01
    status, raw = await post(http, base_url, {"input": "hi", "background": True})
    queued = json.loads(raw)
    assert status == 200 and queued["status"] == "queued" and queued["background"] and queued["output"] == []
    for _ in range(200):
        made = await _get(http, base_url, queued["id"])
        if made["status"] not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.01)
    assert made["status"] == "completed" and made["output"][0]["content"][0]["text"] == "Hello there."
    assert made["usage"]["output_tokens"] == 5


async def test_cancel_stops_a_background_response_and_its_engine_request(http, base_url, engine):
    engine.delay = 0.05
    queued = json.loads((await post(http, base_url, {"input": "hi", "background": True, "max_output_tokens": 100}))[1])
    await asyncio.sleep(0.2)
    async with http.post(f"{base_url}{RESPONSES}/{queued['id']}/cancel") as r:
        assert r.status == 200 and (await r.json())["status"] == "cancelled"
    assert (await _get(http, base_url, queued["id"]))["status"] == "cancelled"
    await engine.wait_cancelled()
    assert len(engine.cancelled) == 1
    status, raw = await post(http, base_url, {"input": "more", "previous_response_id": queued["id"]})
    assert status == 400 and "is cancelled" in json.loads(raw)["error"]["message"]
    async with http.post(f"{base_url}{RESPONSES}/{queued['id']}/cancel") as r:
        error = (await r.json())["error"]
        assert r.status == 400 and "this one is cancelled" in error["message"]


async def test_background_work_counts_against_max_concurrent_requests(http, serve, engine):
    url = await serve(max_concurrent_requests=1)
    engine.delay = 0.05
    queued = json.loads((await post(http, url, {"input": "hi", "background": True, "max_output_tokens": 100}))[1])
    status, raw = await post(http, url, {"input": "hi", "max_output_tokens": 1})
    assert status == 503 and json.loads(raw)["error"]["code"] == "server_overloaded"
    async with http.post(f"{url}{RESPONSES}/{queued['id']}/cancel") as r:
        assert r.status == 200
    assert (await post(http, url, {"input": "hi", "max_output_tokens": 1}))[0] == 200


async def test_shutdown_cancels_background_responses(http, engine, tokenizer):
    engine.delay = 0.05
    runner, url = await serve_live_gateway(tokenizer, engine.address)
    queued = json.loads((await post(http, url, {"input": "hi", "background": True, "max_output_tokens": 100}))[1])
    store = runner.app[GATEWAY].responses
    await asyncio.sleep(0.1)
    await runner.cleanup()
    assert store.get(queued["id"]).response.status == "cancelled" and not store.running


def test_function_calls_join_the_assistant_message_and_reasoning_goes_with_it():
    items = [InputItem(role="user", content="q"), InputItem(type="reasoning", summary=[]),
             InputItem(type="reasoning", content=[Part(type="reasoning_text", text="think")]),
             InputItem(type="function_call", call_id="a", name="f", arguments="{}"),
             InputItem(type="function_call", call_id="b", name="g", arguments="{}"),
             InputItem(type="function_call_output", call_id="a", output="1"),
             InputItem(type="function_call_output", call_id="b", output="2")]
    messages = chat_messages(items)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c.id for c in messages[1].tool_calls] == ["a", "b"] and messages[1].reasoning == "think"
    assert [m.tool_call_id for m in messages[2:]] == ["a", "b"]


def _stored(response_id: str, size: int) -> StoredResponse:
    response = Response(id=response_id, created_at=0, model="m", status="completed", output=[], instructions=None,
                        max_output_tokens=None, metadata={}, parallel_tool_calls=True, previous_response_id=None,
                        reasoning=None, store=True, temperature=None, text=TextOptions(), tool_choice="auto",
                        tools=[], top_p=None)
    return StoredResponse(response, [], [], size)


def test_the_store_drops_the_oldest_past_its_size_and_age(monkeypatch):
    store = ResponseStore(max_bytes=100, ttl_s=60)
    for i in range(3):
        store.put(_stored(f"r{i}", 40))
    assert store.get("r0") is None and store.get("r1") and store.get("r2")
    store.put(_stored("huge", 101))
    assert store.get("huge") is None and store.get("r2")
    later = time.monotonic() + 61
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert store.get("r2") is None


async def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(http, base_url, engine, tokenizer):
    turns = [[{"role": "user", "content": f"turn{i} " + "x" * 40}, {"role": "assistant", "content": "y" * 40}]
             for i in range(4)]
    latest = {"role": "user", "content": "the question"}
    body = {"input": [*sum(turns, []), latest], "instructions": "Be brief.", "max_output_tokens": 16}
    status, raw = await post(http, base_url, body)
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
    status, raw = await post(http, base_url, {**body, "truncation": "auto"})
    assert status == 200 and json.loads(raw)["truncation"] == "auto"
    prompt = list(engine.requests[-1].prompt_token_ids)
    system = [{"role": "system", "content": "Be brief."}]

    def length(first: int) -> int:
        return len(tokenizer.encode(tokenizer.apply_chat_template(system + sum(turns[first:], []) + [latest]),
                                    add_special_tokens=False))
    # The instructions and the latest turn stay, and only as many of the oldest turns go as must.
    dropped = next(first for first in range(5) if length(first) <= 256 - 16)
    assert 0 < dropped < 4 and len(prompt) == length(dropped)
    text = tokenizer.decode(prompt, False)
    assert "Be brief." in text and f"turn{dropped - 1}" not in text and f"turn{dropped}" in text
    status, raw = await post(http, base_url, {"input": "word " * 300, "truncation": "auto"})
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"


async def test_output_text_logprobs_where_include_asks(http, base_url, engine, tokenizer, validate):
    reply(engine, tokenizer, "Hello there.")
    ask = {"input": "hi", "top_logprobs": 2, "include": ["message.output_text.logprobs"]}
    status, body = await post(http, base_url, ask)
    made = json.loads(body)
    validate("Response", made)
    assert made["top_logprobs"] == 2
    logprobs = made["output"][0]["content"][0]["logprobs"]
    # The fake engine's: output token i at -0.01 * (i + 1), its top ones it and the next ids.
    assert [lp["logprob"] for lp in logprobs] == pytest.approx([-0.01 * (i + 1) for i in range(5)])
    assert "".join(lp["token"] for lp in logprobs) == "Hello there." + tokenizer.decode([engine.eos],
                                                                                           skip_special_tokens=False)
    assert all(len(lp["top_logprobs"]) == 2 and lp["top_logprobs"][0]["token"] == lp["token"]
               and lp["bytes"] == list(lp["token"].encode()) for lp in logprobs)
    assert engine.requests[-1].params.logprobs == 2
    status, raw = await post(http, base_url, {**ask, "stream": True})
    events = sse(raw)
    for name, data in events:
        validate(EVENT_SCHEMAS[name], data)
    streamed = [lp for n, d in events if n == "response.output_text.delta" for lp in d["logprobs"]]
    done = next(d for n, d in events if n == "response.output_text.done")
    # The end-of-text token, in a step of no text, reaches the done events only.
    assert done["logprobs"] == events[-1][1]["response"]["output"][0]["content"][0]["logprobs"] == streamed + [
        done["logprobs"][-1]]
    assert [lp["token"] for lp in done["logprobs"]] == [lp["token"] for lp in logprobs]


async def test_no_logprobs_without_include(http, base_url, engine, tokenizer):
    reply(engine, tokenizer, "Hello there.")
    status, body = await post(http, base_url, {"input": "hi", "top_logprobs": 3})
    assert status == 200 and json.loads(body)["output"][0]["content"][0]["logprobs"] == []
    assert not engine.requests[-1].params.HasField("logprobs")
