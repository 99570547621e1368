"""Agent and evaluation traffic against real processes on the default model: `pagedserve serve
--enable-auto-tool-choice --tool-call-parser hermes`, and a second gateway with --reasoning-parser
qwen3 on the same scheduler. Clients: the openai SDK, LangChain, a replay of Dify's merge rule.

The small model does not write tool calls by itself, so `auto` tests force the text it would write
with a regex (structured outputs apply under `auto` too); `required` and named choices are forced
by the server's own schemas."""
import json
from typing import Literal

import jsonschema
import pytest
import requests
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.serving import DEFAULT_MODEL_NAME as MODEL

WEATHER_ARGS = {"city": "Dallas", "state": "TX"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "state"],
                   "properties": {"city": {"enum": ["Dallas", "Austin"]}, "state": {"enum": ["TX"]}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Dallas?"}]


def hermes_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def literal(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$-" else "\\n" if c == "\n" else c for c in text)


def force(text: str) -> dict:
    return {"structured_outputs": {"regex": literal(text)}}


FORCE_CALL = force(hermes_call("get_weather", WEATHER_ARGS))
FORCE_TWO = force(hermes_call("get_weather", WEATHER_ARGS) + "\n" + hermes_call("get_time", {"zone": "UTC"}))


# A question the small model answers, greedily, with a JSON object that it closes.
JSON_ASK = "Give me a JSON object with a name and an age."


class Car(BaseModel):
    brand: Literal["vw", "bmw"]
    electric: bool
    doors: Literal[2, 4]


def chat(client, **options):
    options = {"messages": ASK, "max_tokens": 80, **options}
    return client.chat.completions.create(model=MODEL, **options)


def raw_chunks(url: str, body: dict) -> list[dict]:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 80, "stream": True, **body}
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        lines = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def merged_calls(chunks: list[dict]) -> dict[int, dict]:
    """Tool-call deltas merged by index, checking the rules clients depend on."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for delta in choice["delta"].get("tool_calls", []):
                assert isinstance(delta["index"], int)
                call = calls.setdefault(delta["index"], {"arguments": ""})
                for key in ("id", "type"):
                    if key in delta:
                        assert key not in call, f"{key} sent twice"
                        call[key] = delta[key]
                if "name" in delta["function"]:
                    assert "name" not in call, "name sent twice"
                    call["name"] = delta["function"]["name"]
                call["arguments"] += delta["function"].get("arguments", "")
    return calls


def finish_reasons(chunks: list[dict]) -> list[str]:
    return [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")]


def test_auto_tool_call_non_stream(client):
    choice = chat(client, tools=TOOLS, tool_choice="auto", extra_body=FORCE_CALL).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and len(call.id) >= 9
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == WEATHER_ARGS


def test_auto_tool_call_stream_raw_and_with_the_sdk_helper(client, url):
    chunks = raw_chunks(url, {"tools": TOOLS, "tool_choice": "auto", **FORCE_CALL})
    calls = merged_calls(chunks)
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["type"] == "function"
    assert json.loads(calls[0]["arguments"]) == WEATHER_ARGS
    assert finish_reasons(chunks) == ["tool_calls"]
    with client.chat.completions.stream(model=MODEL, messages=ASK, max_tokens=80, tools=TOOLS,
                                        extra_body=FORCE_CALL) as stream:
        final = stream.get_final_completion()
    assert json.loads(final.choices[0].message.tool_calls[0].function.arguments) == WEATHER_ARGS


def test_two_parallel_calls(client, url):
    calls = chat(client, tools=TOOLS, extra_body=FORCE_TWO).choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2
    streamed = merged_calls(raw_chunks(url, {"tools": TOOLS, **FORCE_TWO}))
    assert sorted(streamed) == [0, 1] and streamed[0]["id"] != streamed[1]["id"]
    assert json.loads(streamed[1]["arguments"]) == {"zone": "UTC"}


def test_dify_merge_rule_yields_one_call(url):
    chunks = raw_chunks(url, {"tools": TOOLS, **FORCE_CALL})
    calls: list[dict] = []
    for chunk in chunks:
        for delta in chunk["choices"][0]["delta"].get("tool_calls", []):
            name = delta["function"].get("name")
            if name:
                found = next((c for c in calls if c["name"] == name), None)
                if found is None:
                    calls.append(found := {"name": name, "arguments": ""})
                found["arguments"] += delta["function"].get("arguments", "")
            elif calls:
                calls[-1]["arguments"] += delta["function"].get("arguments", "")
    assert len(calls) == 1 and json.loads(calls[0]["arguments"]) == WEATHER_ARGS


def test_tool_choice_none_named_and_required(client, url):
    plain = chat(client, tools=TOOLS, tool_choice="none", max_tokens=8).choices[0]
    assert not plain.message.tool_calls and plain.message.content
    named = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert named.finish_reason == "stop" and named.message.content is None
    assert named.message.tool_calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(named.message.tool_calls[0].function.arguments), TOOLS[1]["function"]["parameters"])
    required = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0).choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    call = required.message.tool_calls[0]
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    streamed = merged_calls(raw_chunks(url, {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                                             "temperature": 0}))
    assert [c["name"] for c in streamed.values()] == [call.function.name]
    assert json.loads(streamed[0]["arguments"]) == json.loads(call.function.arguments)


QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{%- for tc in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_tool_result_round_trip(client, url):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(WEATHER_ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "98F"}]
    assert chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4).choices[0].message.content
    body = {"model": MODEL, "messages": history, "tools": TOOLS, "chat_template": QWEN_LIKE_TEMPLATE}
    tokens = requests.post(f"{url}/tokenize", json=body, timeout=30).json()["tokens"]
    text = requests.post(f"{url}/detokenize", json={"model": MODEL, "tokens": tokens}, timeout=30).json()["prompt"]
    assert "<tool_response>\n98F\n</tool_response>" in text
    assert '"arguments": {"city": "Dallas", "state": "TX"}' in text
    assert '"name": "get_time"' in text


def test_sdk_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A car?"}],
                                               response_format=Car, max_tokens=64)
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(completion.choices[0].message.parsed, Car)


def test_structured_outputs_validate_streamed_too(url):
    # Closed, as OpenAI's strict mode requires of a schema: an open one lets a sampled answer add
    # properties past max_tokens (a run on 2026-12-06 did).
    schema = {**Car.model_json_schema(), "additionalProperties": False}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "car", "schema": schema, "strict": True}},
            "max_tokens": 64, "temperature": 0}
    chunks = raw_chunks(url, body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), schema)
    assert finish_reasons(chunks) == ["stop"]


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_regex": r"\d{3}-\d{4}"}, lambda t: len(t) == 8 and t[3] == "-"),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
])
def test_each_spelling_constrains(client, extra, check):
    messages = [{"role": "user", "content": JSON_ASK}]
    answer = chat(client, messages=messages, temperature=0, extra_body=extra).choices[0]
    assert answer.finish_reason == "stop" and check(answer.message.content), answer.message.content


def test_completions_echo_logprobs_and_prompt_logprobs(url):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "echo": True, "logprobs": 1,
            "prompt_logprobs": 1, "temperature": 0}
    choice = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == 5 + 2 and all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == choice["text"] and choice["text"].startswith("The capital of France is")
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == 5


@tool
def get_weather(city: Literal["Dallas", "Austin"], state: Literal["TX"]) -> str:
    """The weather in a city."""
    return "98F"


def langchain(url: str, **options) -> ChatOpenAI:
    return ChatOpenAI(**{"base_url": f"{url}/v1", "api_key": "EMPTY", "model": MODEL, "max_tokens": 80,
                         "max_retries": 0, **options})


def test_langchain_bind_tools_invoke_and_stream(url):
    llm = langchain(url, extra_body=FORCE_CALL).bind_tools([get_weather], tool_choice="auto")
    message = llm.invoke("What is the weather in Dallas?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", WEATHER_ARGS)]
    assert not message.invalid_tool_calls
    merged = None
    for chunk in llm.stream("What is the weather in Dallas?"):
        merged = chunk if merged is None else merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", WEATHER_ARGS)]
    history = [HumanMessage("What is the weather in Dallas?"), message,
               ToolMessage("98F", tool_call_id=message.tool_calls[0]["id"])]
    assert isinstance(langchain(url, max_tokens=4).bind_tools([get_weather], tool_choice="none").invoke(history),
                      AIMessage)


class Reply(BaseModel):
    """Any JSON object parses into it (json_mode promises JSON, not this schema)."""
    answer: str = ""


@pytest.mark.parametrize("method, schema", [("json_schema", Car), ("function_calling", Car), ("json_mode", Reply)])
def test_langchain_with_structured_output(url, method, schema):
    llm = langchain(url, temperature=0).with_structured_output(schema, method=method)
    assert isinstance(llm.invoke(JSON_ASK), schema)


REASONING = "<think>\nplan\n</think>\n\nanswer"


def test_reasoning_split_non_stream_and_stream(servers):
    url = servers["reasoning"]
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, **force(REASONING)}
    message = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("\nplan\n", "\nplan\n", "answer")
    chunks = raw_chunks(url, force(REASONING))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "\nplan\n"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "\nplan\n"
    assert "".join(d.get("content") or "" for d in deltas) == "answer"


THINKING_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                     "{% endfor %}{{ '<|im_start|>assistant\\n' }}"
                     "{% if enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}")


def test_chat_template_kwargs_reach_the_template_and_end_the_thinking(servers):
    url = servers["reasoning"]
    body = {"model": MODEL, "messages": ASK, "max_tokens": 10, "chat_template": THINKING_TEMPLATE,
            "chat_template_kwargs": {"enable_thinking": False}, **force("answer")}
    tokens = requests.post(f"{url}/tokenize", json=body, timeout=30).json()["tokens"]
    text = requests.post(f"{url}/detokenize", json={"model": MODEL, "tokens": tokens}, timeout=30).json()["prompt"]
    assert text.endswith("<think>\n\n</think>\n\n")
    message = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert message["content"] == "answer" and "reasoning" not in message
