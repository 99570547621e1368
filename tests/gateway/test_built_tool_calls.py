"""The tool-call formats whose arguments are no JSON (pythonic, llama4_pythonic, qwen3_coder): the
arguments built as JSON, what vLLM's parsers give for the same text, streamed at every cut into
what the non-stream message holds, and through the gateway with --tool-call-parser."""
import json

import msgspec
import pytest

from pagedserve.gateway import tool_parsers
from pagedserve.gateway.chat_output import ChatOutputOptions, ChoiceOutput
from pagedserve.gateway.output_events import ToolCallDelta
from pagedserve.gateway.schemas import Tool
from pagedserve.gateway.xml_calls import typed
from tests.gateway.test_tool_parsers import WEATHER_TOOLS, chat_choices, check_every_cut

TOOLS = msgspec.convert([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "where": {"type": "object"}, "hours": {"type": "array"}, "temp": {"type": ["number", "null"]}}}}},
    {"type": "function", "function": {"name": "now"}}], list[Tool])


def options(name: str) -> ChatOutputOptions:
    return ChatOutputOptions(tools=tool_parsers.parser(name, TOOLS), finish_with_calls=True)


def calls(name: str, text: str) -> list[tuple[str, object]]:
    message = ChoiceOutput(options(name)).message(text)
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


PYTHONIC = {
    "one call": '[get_weather(city="San Francisco", days=3)]',
    "literals": "[get_weather(city='a, b) \\' c', where={'lat': -1.5, 'tags': ['x', (1, 2)]}, metric=True, "
                "temp=None)]",
    "two calls": '[now(), get_weather(city="Grüße 😀")]',
    "llama 4 tags": '<|python_start|>[get_weather(city="Dallas")]<|python_end|>',
    "spaces": ' [ get_weather( city = "Dallas" , days = 2 , ) , now( ) ] ',
    "content": "It is sunny [get_weather()] today.",
    "a name, no literal, after a call": '[now(), get_weather(city=dallas)]',
    "a second value no literal": '[get_weather(city="Dallas", days=2 + 1)]',
    "positional": '[get_weather("Dallas")]',
    "triple quotes": '[get_weather(city="""5" tall, it\'s\n"x\\"""", where={\'code\': \'\'\'a\'b, \'\'\'}, temp=None)]',
    "empty strings": '[get_weather(city="", where={"": \'\'})]',
}


@pytest.mark.parametrize("case", PYTHONIC)
def test_pythonic_streams_what_it_parses_at_every_cut(case):
    check_every_cut(options("pythonic"), PYTHONIC[case])
    check_every_cut(options("llama4_pythonic"), PYTHONIC[case])


@pytest.mark.parametrize("case, expected", [
    ("one call", [("get_weather", {"city": "San Francisco", "days": 3})]),
    ("literals", [("get_weather", {"city": "a, b) ' c", "where": {"lat": -1.5, "tags": ["x", [1, 2]]},
                                   "metric": True, "temp": None})]),
    ("two calls", [("now", {}), ("get_weather", {"city": "Grüße 😀"})]),
    ("llama 4 tags", [("get_weather", {"city": "Dallas"})]),
    ("spaces", [("get_weather", {"city": "Dallas", "days": 2}), ("now", {})]),
    ("content", []),
    ("a name, no literal, after a call", [("now", {})]),
    ("positional", []),
    ("triple quotes", [("get_weather", {"city": '5" tall, it\'s\n"x"', "where": {"code": "a'b, "}, "temp": None})]),
    ("empty strings", [("get_weather", {"city": "", "where": {"": ""}})]),
])
def test_pythonic_message(case, expected):
    assert calls("pythonic", PYTHONIC[case]) == expected


def test_pythonic_arguments_are_what_json_dumps_gives():
    """vLLM's parser json.dumps the keywords (ensure_ascii off): the same text, not just the same value."""
    message = ChoiceOutput(options("pythonic")).message(PYTHONIC["literals"])
    assert message.tool_calls[0].function.arguments == json.dumps(
        {"city": "a, b) ' c", "where": {"lat": -1.5, "tags": ["x", [1, 2]]}, "metric": True, "temp": None},
        ensure_ascii=False)
    assert ChoiceOutput(options("pythonic")).message(PYTHONIC["content"]).content == PYTHONIC["content"]
    positional = ChoiceOutput(options("pythonic")).message(PYTHONIC["positional"])
    assert positional.content == PYTHONIC["positional"] and not positional.tool_calls
    cut = ChoiceOutput(options("pythonic")).message(PYTHONIC["a second value no literal"])
    assert cut.tool_calls[0].function.arguments == '{"city": "Dallas"'


QWEN3_CODER = {
    "typed": ("I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=where>\n"
              '{"lat": 40.7}\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=temp>\n2.0\n'
              "</parameter>\n</function>\n</tool_call>"),
    "two calls": ("<tool_call>\n<function=now>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
                  "<parameter=city>\na < b </para\n</parameter>\n</function>\n</tool_call>"),
    "unclosed parameters": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n<parameter=days>\nsoon"
                            "\n</function>\n</tool_call>"),
    "not typed": "<tool_call>\n<function=unknown>\n<parameter=n>\n7\n</parameter>\n<parameter=x>\nnull\n"
                 "</parameter>\n</function>\n</tool_call>",
    "no call": "A <tool and <function= in words, then the end.",
}


@pytest.mark.parametrize("case", QWEN3_CODER)
def test_qwen3_coder_streams_what_it_parses_at_every_cut(case):
    check_every_cut(options("qwen3_coder"), QWEN3_CODER[case])


@pytest.mark.parametrize("case, expected", [
    ("typed", [("get_weather", {"city": "New York", "days": 3, "metric": True, "where": {"lat": 40.7},
                                "hours": [1, 2], "temp": 2})]),
    ("two calls", [("now", {}), ("get_weather", {"city": "a < b </para"})]),
    ("unclosed parameters", [("get_weather", {"city": "Dallas", "days": "soon"})]),
    ("not typed", [("unknown", {"n": "7", "x": None})]),
    ("no call", []),
])
def test_qwen3_coder_message(case, expected):
    assert calls("qwen3_coder", QWEN3_CODER[case]) == expected
    assert calls("qwen3_xml", QWEN3_CODER[case]) == expected


def test_qwen3_coder_content_and_types():
    read = ChoiceOutput(options("qwen3_coder")).message
    assert read(QWEN3_CODER["typed"]).content == "I'll look.\n"
    assert read(QWEN3_CODER["no call"]).content == QWEN3_CODER["no call"]
    # vLLM's rules: a value that does not read as its type stays text; a float that is whole an int.
    assert typed("three", "integer") == "three" and typed("2.5", "number") == 2.5
    assert typed("yes", "boolean") is False and typed("{'a': 1}", "object") == {"a": 1}
    assert typed("1e999", "number") == float("inf")
    inf = ChoiceOutput(options("qwen3_coder")).message(
        "<tool_call><function=get_weather><parameter=temp>1e999</parameter></function></tool_call>")
    assert json.loads(inf.tool_calls[0].function.arguments) == {"temp": "1e999"}


@pytest.mark.parametrize("name, text", [
    ("pythonic", f'[get_weather(city="{"x" * 100_000}")]'),
    ("qwen3_coder", f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{'x' * 100_000}\n</parameter>\n"
                    "</function>\n</tool_call>")])
def test_a_long_argument_streamed_a_character_at_a_time_takes_linear_time(name, text):
    import time
    out, fragments = ChoiceOutput(options(name)), []
    started = time.perf_counter()
    for i, char in enumerate(text):
        fragments += [e.arguments_fragment for e in out.read(char, final=i == len(text) - 1)
                      if isinstance(e, ToolCallDelta)]
        assert time.perf_counter() - started < 1.0, f"1 s spent by character {i} of {len(text)}"
    assert json.loads("".join(fragments)) == {"city": "x" * 100_000}


async def test_pythonic_calls_through_the_gateway(http, engine, tokenizer):
    [choice] = await chat_choices(http, engine, tokenizer, '[get_weather(city="Dallas", days=2)]',
                                  [{"tools": WEATHER_TOOLS}], tool_parser="pythonic")
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Dallas", "days": 2})
