"""/v1/messages and the Ollama API against real processes on the default model (`pagedserve serve
--enable-auto-tool-choice --tool-call-parser hermes`, conftest's), at temperature 0, with the anthropic
SDK, the ollama client and LangChain's ChatAnthropic and ChatOllama: streamed text == whole text ==
chat's text for the same conversation, and the usage agrees.

The small model does not call tools by itself: the Anthropic round trip forces the call with
tool_choice (a named tool or "any"), which the server's own schemas enforce."""
import anthropic
import ollama
import openai
import pytest
from langchain_anthropic import ChatAnthropic
from langchain_ollama import ChatOllama

from tests.serving import DEFAULT_MODEL_NAME as MODEL

ASK = [{"role": "user", "content": "What is the weather in Dallas?"}]
TOKENS = 8
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"enum": ["Dallas", "Austin"]}}}}
OLLAMA_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}
# Room for a whole forced call ([{"name": ..., "parameters": ...}] is about 20 tokens).
CALL_TOKENS = 40


@pytest.fixture(scope="module")
def chat(url):
    """Chat completions' greedy reply to ASK, TOKENS long: what every protocol must say too."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120) as client:
        return client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=TOKENS)


# Anthropic's SDK no longer has the sampling fields; the server still reads them.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key="EMPTY", max_retries=0, timeout=120)


def test_messages_create_and_stream_say_what_chat_says(claude, chat):
    whole = claude.messages.create(model=MODEL, messages=ASK, max_tokens=TOKENS, **GREEDY)
    with claude.messages.stream(model=MODEL, messages=ASK, max_tokens=TOKENS, **GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert whole.content[0].text == streamed == final.content[0].text == chat.choices[0].message.content
    for message in (whole, final):
        assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                              chat.usage.completion_tokens)
        assert message.stop_reason == "max_tokens"
    counted = claude.messages.count_tokens(model=MODEL, messages=ASK)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_messages_tool_use_then_tool_result(claude):
    named = {"type": "tool", "name": "get_weather"}
    whole = claude.messages.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=named,
                                   max_tokens=CALL_TOKENS, **GREEDY)
    with claude.messages.stream(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"},
                                max_tokens=CALL_TOKENS, **GREEDY) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        [call] = [block for block in message.content if block.type == "tool_use"]
        assert (call.name, call.input) == ("get_weather", {"city": "Dallas"}) and message.stop_reason == "tool_use"
    history = [*ASK, {"role": "assistant", "content": whole.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": whole.content[-1].id,
                                             "content": "Sunny, 31 C"}]}]
    answer = claude.messages.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice={"type": "none"},
                                    max_tokens=TOKENS, **GREEDY)
    assert answer.content[0].type == "text" and answer.content[0].text


def test_ollama_chat_streamed_and_not_says_what_chat_says(url, chat):
    client = ollama.Client(host=url, timeout=120)
    options = {"temperature": 0, "num_predict": TOKENS}
    whole = client.chat(model=MODEL, messages=ASK, options=options)
    parts = list(client.chat(model=MODEL, messages=ASK, options=options, stream=True))
    assert whole.message.content == "".join(p.message.content for p in parts) == chat.choices[0].message.content
    for reply in (whole, parts[-1]):
        assert (reply.prompt_eval_count, reply.eval_count) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    generated = client.generate(model=MODEL, prompt=ASK[0]["content"], options=options)
    assert generated.response == chat.choices[0].message.content


def test_ollama_chat_with_tools_and_a_tool_result_streamed_and_not_agree(url):
    client = ollama.Client(host=url, timeout=120)
    history = [*ASK, {"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Dallas"}}}]},
               {"role": "tool", "content": "Sunny, 31 C", "tool_name": "get_weather"}]
    options = {"temperature": 0, "num_predict": TOKENS}
    whole = client.chat(model=MODEL, messages=history, tools=[OLLAMA_WEATHER], options=options)
    parts = list(client.chat(model=MODEL, messages=history, tools=[OLLAMA_WEATHER], options=options, stream=True))
    assert whole.message.content == "".join(p.message.content for p in parts)
    assert whole.message.tool_calls == ([c for p in parts for c in p.message.tool_calls or ()] or None)
    assert whole.message.content or whole.message.tool_calls


def test_ollama_model_routes(url):
    client = ollama.Client(host=url, timeout=120)
    assert [m.model for m in client.list().models] == [MODEL]
    shown = client.show(MODEL)
    assert shown.capabilities == ["completion", "tools"]
    assert shown.modelinfo[f"{shown.modelinfo['general.architecture']}.context_length"] == 2048


def test_langchain_chat_anthropic_and_chat_ollama_invoke_and_stream(url, chat):
    expected = chat.choices[0].message.content
    models = [ChatAnthropic(base_url=url, api_key="EMPTY", model=MODEL, max_tokens=TOKENS, temperature=0,
                            max_retries=0),
              ChatOllama(base_url=url, model=MODEL, num_predict=TOKENS, temperature=0)]
    for llm in models:
        assert llm.invoke(ASK[0]["content"]).text == expected
        assert "".join(chunk.text for chunk in llm.stream(ASK[0]["content"])) == expected
