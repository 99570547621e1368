"""An Ollama /api/chat or /api/generate body read into chat's terms."""
import msgspec
import pytest

from pagedserve.gateway import ollama_request as orq
from pagedserve.gateway.errors import APIError
from pagedserve.gateway.ollama_schemas import ChatRequest, GenerateRequest
from pagedserve.gateway.schemas import decode_request


def chat(**fields) -> ChatRequest:
    fields = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_request(msgspec.json.encode(fields), ChatRequest)


def generate(**fields) -> GenerateRequest:
    return decode_request(msgspec.json.encode({"model": "m", "prompt": "hi", **fields}), GenerateRequest)


def test_streams_by_default_as_ollama_does():
    assert chat().stream and generate().stream and not chat(stream=False).stream


def test_tool_calls_with_object_arguments_and_tool_results():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "thinking": "Call it.",
                 "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "21C", "tool_name": "get_weather"}]
    out = [msgspec.to_builtins(m) for m in orq.chat_messages(chat(messages=messages).messages)]
    assert out[1]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                                     "id": None, "type": "function"}]
    assert out[1]["reasoning"] == "Call it."
    assert (out[2]["role"], out[2]["content"], out[2]["name"]) == ("tool", "21C", "get_weather")


def test_generate_is_a_user_turn_after_the_system_prompt():
    out = [(m.role, m.content) for m in orq.generate_messages(generate(system="Be brief."))]
    assert out == [("system", "Be brief."), ("user", "hi")]


def test_options_format_and_think():
    assert [orq.max_tokens(n) for n in (None, -1, -2, 0, 30)] == [None, None, None, 0, 30]
    assert orq.constraint("") is None and orq.constraint(None) is None
    assert orq.constraint("json").json_object
    assert orq.constraint({"type": "object"}).json == {"type": "object"}
    assert orq.template_kwargs(False) == {"enable_thinking": False}
    assert orq.template_kwargs("high") == {"enable_thinking": True, "reasoning_effort": "high"}
    assert orq.template_kwargs(None) is None


@pytest.mark.parametrize("fields, param", [
    ({"suffix": "end"}, "suffix"), ({"template": "{{ .Prompt }}"}, "template"), ({"context": [1, 2]}, "context"),
    ({"images": ["AA=="]}, "images"), ({"raw": True, "system": "x"}, "system"),
])
def test_generate_fields_that_cannot_run_are_400s(fields, param):
    with pytest.raises(APIError) as e:
        orq.check_generate(generate(**fields))
    assert e.value.status == 400 and e.value.info.param == param


def test_images_in_chat_are_a_400():
    with pytest.raises(APIError) as e:
        orq.chat_messages(chat(messages=[{"role": "user", "content": "x", "images": ["AA=="]}]).messages)
    assert e.value.info.param == "messages[0].images"


@pytest.mark.parametrize("fields, param", [({"model": ""}, "model"), ({"format": "xml"}, "format"),
                                           ({"options": {"temperature": "hot"}}, "options.temperature"),
                                           ({"messages": [{"role": "robot"}]}, "messages[0].role")])
def test_malformed_bodies_are_400s(fields, param):
    with pytest.raises(APIError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.info.param == param


def test_more_than_16_stop_strings_are_a_400():
    with pytest.raises(APIError) as e:
        chat(options={"stop": ["x"] * 17})
    assert e.value.info.param == "options.stop"
