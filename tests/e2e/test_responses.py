"""/v1/responses against real processes on the default model (`pagedserve serve --enable-auto-tool-choice
--tool-call-parser hermes`, conftest's), at temperature 0, with the openai SDK and the openai-agents SDK.

The small model does not call tools by itself: the round trips force the call with tool_choice
(named or "required"), which the server's own schemas enforce."""
import json
import time

import agents
import jsonschema
import openai
import pytest
import requests

from tests.serving import DEFAULT_MODEL_NAME as MODEL

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["Dallas", "Austin"]}}}}
ASK = "What is the weather in Dallas?"
CAR = {"type": "object", "additionalProperties": False, "required": ["brand", "doors"],
       "properties": {"brand": {"enum": ["vw", "bmw"]}, "doors": {"enum": [2, 4]}}}
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
# Room for a whole forced call ([{"name": ..., "parameters": ...}] is about 20 tokens).
CALL = GREEDY | {"max_output_tokens": 40}


def test_create_stream_and_chat_agree(client):
    """Streamed text == non-streamed text == chat's text for the same conversation; usage agrees."""
    made = client.responses.create(input=ASK, instructions="Answer briefly.", **GREEDY)
    assert made.status == "incomplete" or made.status == "completed"
    assert made.output_text and made.output[0].type == "message"
    with client.responses.stream(input=ASK, instructions="Answer briefly.", **GREEDY) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == made.output_text
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}])
    assert chat.choices[0].message.content == made.output_text
    assert (made.usage.input_tokens, made.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)


def test_stream_helper_final_response(client):
    with client.responses.stream(input="Say hello.", model=MODEL, temperature=0, max_output_tokens=200) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert final.status == "completed" and final.output_text and final.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_function_round_trip_with_previous_response_id(client):
    first = client.responses.create(input=ASK, tools=[WEATHER], tool_choice="required", **CALL)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Dallas"} and call.call_id
    second = client.responses.create(previous_response_id=first.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 31 C"}], **GREEDY)
    assert second.output_text and second.previous_response_id == first.id
    listed = client.responses.input_items.list(second.id)
    assert [item.type for item in listed.data] == ["function_call_output"]


def test_function_round_trip_with_explicit_items(client):
    named = {"type": "function", "name": "get_weather"}
    first = client.responses.create(input=ASK, tools=[WEATHER], tool_choice=named, store=False, **CALL)
    [call] = [item for item in first.output if item.type == "function_call"]
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 31 C"}]
    second = client.responses.create(input=items, tools=[WEATHER], **GREEDY)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, tools=[
        {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}], messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 31 C"}])
    assert second.output_text == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_a_background_response_matches_a_foreground_one(client):
    queued = client.responses.create(input=ASK, background=True, **GREEDY)
    assert queued.status == "queued"
    for _ in range(600):
        made = client.responses.retrieve(queued.id)
        if made.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert made.output_text == client.responses.create(input=ASK, **GREEDY).output_text


def test_json_schema_output_validates(client):
    made = client.responses.create(input="Describe a car as JSON.", model=MODEL, temperature=0, max_output_tokens=60,
                                   text={"format": {"type": "json_schema", "name": "car", "schema": CAR,
                                                    "strict": True}})
    jsonschema.validate(json.loads(made.output_text), CAR)


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "background": True, "stream": True}, "background"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": []}, "input"),
])
def test_hostile_input_gets_an_openai_shaped_400(url, body, param):
    r = requests.post(f"{url}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_an_openai_agents_agent_runs_one_function_tool(url):
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "Sunny, 31 C"

    model = agents.OpenAIResponsesModel(MODEL, openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY"))
    agent = agents.Agent(name="weather", instructions="Answer with the tool's result.", tools=[get_weather],
                         model=model, model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                          max_tokens=40))
    result = agents.Runner.run_sync(agent, ASK, max_turns=2)
    assert len(calls) == 1 and result.final_output
