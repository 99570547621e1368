"""The Ollama routes on the fake engine, through the ollama client and raw: the same text and counts
as chat, streamed (NDJSON, the default) or not; options, format, tools and thinking; the model
routes; errors in Ollama's shape, never a 500."""
import json

import ollama
import openai
import pytest

from pagedserve.gateway.errors import MAX_BODY_BYTES
from tests.gateway.fake_engine import MAX_MODEL_LEN, MODEL, REPLY

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"city": "Paris"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
HERMES_CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}\n</tool_call>'


async def openai_reply(url: str, max_tokens: int, **body):
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0) as client:
        if "prompt" in body:
            return await client.completions.create(model=MODEL, max_tokens=max_tokens, **body)
        return await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, **body)


async def lines(http, url: str, path: str, body: dict) -> list[dict]:
    async with http.post(url + path, json={"model": MODEL, **body}) as r:
        assert r.status == 200 and r.content_type == "application/x-ndjson"
        text = await r.text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


async def test_chat_streamed_and_not_says_what_chat_completions_says(base_url):
    chat = await openai_reply(base_url, 12)
    client = ollama.AsyncClient(host=base_url)
    whole = await client.chat(model=MODEL, messages=MESSAGES, stream=False, options={"num_predict": 12})
    parts = [p async for p in await client.chat(model=f"{MODEL}:latest", messages=MESSAGES, stream=True,
                                                options={"num_predict": 12})]
    streamed = "".join(p.message.content for p in parts)
    assert whole.message.content == streamed == chat.choices[0].message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].message.content == ""
    for reply in (whole, parts[-1]):
        assert reply.done_reason == "length" and reply.message.role == "assistant"
        assert (reply.prompt_eval_count, reply.eval_count) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
        assert reply.total_duration >= reply.eval_duration > 0 and reply.load_duration == 0
    assert parts[0].model == f"{MODEL}:latest" and whole.model == MODEL


async def test_generate_renders_the_prompt_as_a_chat_turn_or_raw(base_url, engine):
    chat = await openai_reply(base_url, 8)
    completion = await openai_reply(base_url, 8, prompt="hi")
    client = ollama.AsyncClient(host=base_url)
    whole = await client.generate(model=MODEL, prompt="hi", options={"num_predict": 8})
    templated = list(engine.requests[-1].prompt_token_ids)
    streamed = "".join([p.response async for p in await client.generate(model=MODEL, prompt="hi", stream=True,
                                                                         options={"num_predict": 8})])
    raw = await client.generate(model=MODEL, prompt="hi", raw=True, options={"num_predict": 8})
    assert whole.response == streamed == chat.choices[0].message.content == raw.response
    assert whole.prompt_eval_count == chat.usage.prompt_tokens == len(templated)
    assert raw.prompt_eval_count == completion.usage.prompt_tokens < whole.prompt_eval_count
    assert whole.done and whole.done_reason == "length" and whole.context is None


async def test_options_and_format_reach_the_engine(base_url, engine):
    options = {"num_predict": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "seed": 3,
               "stop": ["zzz"], "repeat_penalty": 1.2, "num_ctx": 4096, "mirostat": 0}
    await ollama.AsyncClient(host=base_url).chat(model=MODEL, messages=MESSAGES, options=options, format="json")
    p = engine.requests[-1].params
    assert (p.max_tokens, p.top_k, p.seed) == (7, 20, 3)
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.9) and p.min_p == pytest.approx(0.1)
    assert p.repetition_penalty == pytest.approx(1.2) and p.structured_outputs.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    await ollama.AsyncClient(host=base_url).generate(model=MODEL, prompt="hi", format=schema)
    assert json.loads(engine.requests[-1].params.structured_outputs.json) == schema
    await ollama.AsyncClient(host=base_url).generate(model=MODEL, prompt="hi", options={"num_predict": -1})
    assert not engine.requests[-1].params.HasField("max_tokens")


async def test_tool_calls_whole_and_streamed(serve, engine, tokenizer):
    url = await serve(tool_parser="hermes")
    engine.reply = tokenizer.encode(HERMES_CALL, add_special_tokens=False) + [engine.eos]
    client = ollama.AsyncClient(host=url)
    whole = await client.chat(model=MODEL, messages=MESSAGES, tools=TOOLS)
    parts = [p async for p in await client.chat(model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True)]
    streamed = [c for p in parts for c in p.message.tool_calls or ()]
    for calls in (whole.message.tool_calls, streamed):
        assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", WEATHER)]
    assert whole.message.content == "" and whole.done_reason == parts[-1].done_reason == "stop"
    history = [*MESSAGES, whole.message.model_dump(exclude_none=True),
               {"role": "tool", "content": "21C", "tool_name": "get_weather"}]
    engine.reply = tokenizer.encode("Sunny.", add_special_tokens=False) + [engine.eos]
    answer = await client.chat(model=MODEL, messages=history, tools=TOOLS)
    assert answer.message.content == "Sunny." and "<|tool|>21C" in tokenizer.decode(
        list(engine.requests[-1].prompt_token_ids))


async def test_thinking_with_a_reasoning_parser(serve, engine, tokenizer):
    url = await serve(reasoning_parser="qwen3")
    engine.reply = tokenizer.encode("<think>Plan it.</think>The answer.", add_special_tokens=False) + [engine.eos]
    client = ollama.AsyncClient(host=url)
    whole = await client.chat(model=MODEL, messages=MESSAGES, think=True)
    parts = [p async for p in await client.chat(model=MODEL, messages=MESSAGES, think=True, stream=True)]
    assert (whole.message.thinking, whole.message.content) == ("Plan it.", "The answer.")
    assert "".join(p.message.thinking or "" for p in parts) == "Plan it."
    assert "".join(p.message.content for p in parts) == "The answer."
    generated = await client.generate(model=MODEL, prompt="hi", think=True)
    assert (generated.thinking, generated.response) == ("Plan it.", "The answer.")


async def test_nothing_to_generate_answers_loaded(base_url, engine):
    client = ollama.AsyncClient(host=base_url)
    for reply in (await client.chat(model=MODEL, messages=[]), await client.generate(model=MODEL)):
        assert reply.done and reply.done_reason == "load"
    assert not engine.requests


async def test_model_routes(serve):
    url = await serve(tool_parser="hermes", sampling_defaults={"temperature": 0.6, "repetition_penalty": 1.1,
                                                               "max_tokens": 256})
    client = ollama.AsyncClient(host=url)
    [listed] = (await client.list()).models
    [running] = (await client.ps()).models
    assert listed.model == running.model == MODEL and listed.digest == running.digest
    assert running.context_length == MAX_MODEL_LEN
    shown = await client.show(f"{MODEL}:latest")
    assert shown.capabilities == ["completion", "tools"]
    architecture = shown.modelinfo["general.architecture"]
    assert shown.modelinfo[f"{architecture}.context_length"] == MAX_MODEL_LEN
    assert shown.parameters.split() == ["temperature", "0.6", "repeat_penalty", "1.1", "num_predict", "256"]
    # VS Code's Copilot refuses an Ollama server below 0.6.4.
    version = (await client._request_raw("GET", "/api/version")).json()["version"]
    assert tuple(map(int, version.split("."))) >= (0, 6, 4)


async def test_curl_style_form_bodies_are_read_as_json(http, base_url):
    """Ollama's own examples post with `curl -d`, which sends a form's Content-Type."""
    async with http.post(f"{base_url}/api/generate", data=json.dumps({"model": MODEL, "prompt": "hi", "stream": False,
                                                                      "options": {"num_predict": 3}})) as r:
        assert r.status == 200 and REPLY.startswith((await r.json())["response"])


async def test_ndjson_stream_lines(http, base_url):
    chunks = await lines(http, base_url, "/api/chat", {"messages": MESSAGES, "options": {"num_predict": 4}})
    assert all(set(c) == {"model", "created_at", "message", "done"} for c in chunks[:-1])
    assert chunks[-1]["done"] and chunks[-1]["eval_count"] == 4 and chunks[-1]["created_at"].endswith("Z")


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/api/chat", {"model": "llama3.2", "messages": MESSAGES}, 404),
    ("POST", "/api/chat", {"messages": MESSAGES}, 400),
    ("POST", "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["AA=="]}]},
     400),
    ("POST", "/api/chat", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}, 400),
    ("POST", "/api/chat", {"model": MODEL, "messages": MESSAGES, "options": {"stop": ["x" * 1_000_000]}}, 400),
    ("POST", "/api/chat", {"model": MODEL, "messages": MESSAGES, "options": {"temperature": 9}}, 400),
    ("POST", "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hello world " * 200}]}, 400),
    ("POST", "/api/generate", {"model": MODEL, "prompt": "hi", "suffix": "end"}, 400),
    ("POST", "/api/generate", {"model": MODEL, "prompt": "hi", "format": {"type": "object",
                                                                          "description": "x" * 4_000_000}}, 400),
    ("POST", "/api/show", {}, 400),
    ("POST", "/api/show", {"model": "llama3.2"}, 404),
    ("POST", "/api/pull", {"model": MODEL}, 404),
    ("GET", "/api/chat", None, 405),
])
async def test_bad_requests_get_ollama_errors(http, base_url, method, path, body, status):
    async with http.request(method, base_url + path, json=body) as r:
        assert r.status == status
        error = await r.json()
    assert list(error) == ["error"] and isinstance(error["error"], str) and error["error"]


async def test_malformed_bodies_get_ollama_errors(http, base_url):
    for data, status in ((b"{not json", 400), (b"x" * (MAX_BODY_BYTES + 1), 413)):
        async with http.post(f"{base_url}/api/chat", data=data) as r:
            assert r.status == status and list(await r.json()) == ["error"]


async def test_the_client_raises_response_errors(serve):
    url = await serve(api_key="sk-key")
    with pytest.raises(ollama.ResponseError) as e:
        await ollama.AsyncClient(host=url).list()
    assert e.value.status_code == 401
    keyed = ollama.AsyncClient(host=url, headers={"Authorization": "Bearer sk-key"})
    assert (await keyed.list()).models
    with pytest.raises(ollama.ResponseError) as e:
        await keyed.chat(model="llama3.2", messages=MESSAGES)
    assert e.value.status_code == 404 and "llama3.2" in e.value.error


async def test_a_failure_mid_stream_is_an_error_line(http, base_url, engine):
    engine.fail_after = 3
    chunks = await lines(http, base_url, "/api/chat", {"messages": MESSAGES, "options": {"num_predict": 10}})
    assert list(chunks[-1]) == ["error"] and "/secret" not in chunks[-1]["error"]
    with pytest.raises(ollama.ResponseError):
        async for _ in await ollama.AsyncClient(host=base_url).chat(model=MODEL, messages=MESSAGES, stream=True):
            pass


async def test_logprobs_whole_and_streamed(base_url):
    client = ollama.AsyncClient(host=base_url)
    asked = dict(model=MODEL, messages=MESSAGES, options={"num_predict": 6}, logprobs=True, top_logprobs=2)
    whole = await client.chat(**asked)
    parts = [p async for p in await client.chat(**asked, stream=True)]
    streamed = [lp for p in parts for lp in p.logprobs or ()]
    assert [lp.token for lp in streamed] == [lp.token for lp in whole.logprobs] and len(streamed) == 6
    assert whole.logprobs[0].token == "Hello" and len(whole.logprobs) == whole.eval_count
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob == lp.logprob for lp in whole.logprobs)
    plain = await client.generate(model=MODEL, prompt="hi", options={"num_predict": 3}, logprobs=True)
    assert len(plain.logprobs) == 3 and not plain.logprobs[0].top_logprobs
    assert (await client.chat(model=MODEL, messages=MESSAGES, options={"num_predict": 2})).logprobs is None


async def test_chat_drops_the_oldest_turns_that_do_not_fit_unless_truncate_is_false(http, base_url, engine, tokenizer):
    turns = [[{"role": "user", "content": f"turn{i} " + "x" * 60}, {"role": "assistant", "content": "y" * 60}]
             for i in range(4)]
    body = {"model": MODEL, "messages": [*sum(turns, []), *MESSAGES], "stream": False,
            "options": {"num_predict": 8}}
    async with http.post(f"{base_url}/api/chat", json=body) as r:
        assert r.status == 200
    text = tokenizer.decode(list(engine.requests[-1].prompt_token_ids), False)
    assert "turn0" not in text and "turn3" in text and text.endswith("<|user|>hi\n<|assistant|>")
    async with http.post(f"{base_url}/api/chat", json={**body, "truncate": False}) as r:
        assert r.status == 400 and "maximum context length" in (await r.json())["error"]
