"""An Anthropic Messages body read into chat's terms: system, blocks, tool results, tools, tool_choice."""
import msgspec
import pytest

from pagedserve.gateway import anthropic_request as ar
from pagedserve.gateway.anthropic_schemas import MessagesRequest
from pagedserve.gateway.errors import APIError
from pagedserve.gateway.schemas import NamedToolChoice, decode_request

WEATHER = {"name": "get_weather", "description": "The weather.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def body(**fields) -> MessagesRequest:
    fields = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_request(msgspec.json.encode(fields), MessagesRequest)


def as_dicts(req: MessagesRequest) -> list[dict]:
    return [{k: v for k, v in msgspec.to_builtins(m).items() if v is not None} for m in ar.chat_messages(req)]


def test_system_string_or_blocks_leads():
    assert as_dicts(body(system="Be brief.")) == [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "hi"}]
    blocks = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind.", "cache_control": {}}]
    assert as_dicts(body(system=blocks))[0] == {"role": "system", "content": "Be brief.\nBe kind."}


def test_a_tool_use_round_trip_becomes_calls_and_tool_messages():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21C"}]},
            {"type": "text", "text": "Thanks."}]}]
    chat = as_dicts(body(messages=messages, tools=[WEATHER]))
    assert chat[1] == {"role": "assistant", "content": "Let me look.", "reasoning": "Use the tool.",
                       "tool_calls": [{"id": "toolu_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert chat[2:] == [{"role": "tool", "content": "21C", "tool_call_id": "toolu_1"},
                        {"role": "user", "content": "Thanks."}]


def test_tools_and_each_tool_choice():
    [tool] = ar.chat_tools(body(tools=[WEATHER]).tools)
    assert (tool.function.name, tool.function.parameters) == ("get_weather", WEATHER["input_schema"])
    choices = {"auto": "auto", "any": "required", "none": "none"}
    for kind, chat in choices.items():
        assert ar.chat_tool_choice(body(tool_choice={"type": kind}).tool_choice) == chat
    named = ar.chat_tool_choice(body(tool_choice={"type": "tool", "name": "get_weather"}).tool_choice)
    assert isinstance(named, NamedToolChoice) and named.function.name == "get_weather"
    serial = body(tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert ar.parallel_tool_calls(serial.tool_choice) is False
    assert ar.parallel_tool_calls(None) is None


def test_thinking_and_effort_reach_the_template():
    enabled = body(thinking={"type": "enabled", "budget_tokens": 1024})
    assert ar.template_kwargs(enabled.thinking, None) == {"enable_thinking": True}
    adaptive = body(thinking={"type": "adaptive"}, output_config={"effort": "low"})
    assert ar.template_kwargs(adaptive.thinking, adaptive.output_config) == {"enable_thinking": True,
                                                                             "reasoning_effort": "low"}
    assert ar.template_kwargs(body(thinking={"type": "disabled"}).thinking, None) == {"enable_thinking": False}
    assert ar.template_kwargs(None, None) is None


def test_output_config_format_is_the_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    param, constraint = ar.constraint(body(output_config={"format": {"type": "json_schema", "schema": schema}})
                                      .output_config)
    assert param == "output_config.format" and constraint.json == schema
    assert ar.constraint(body(output_config={"effort": "high"}).output_config) is None


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[0].content[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
])
def test_what_cannot_run_is_a_400_naming_the_field(fields, param):
    req = body(**fields)
    with pytest.raises(APIError) as e:
        ar.chat_messages(req)
        ar.chat_tools(req.tools)
    assert e.value.status == 400 and e.value.info.param == param


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": None}, "max_tokens"), ({"temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"), ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
])
def test_malformed_bodies_are_400s(fields, param):
    with pytest.raises(APIError) as e:
        body(**fields)
    assert e.value.status == 400 and e.value.info.param == param
