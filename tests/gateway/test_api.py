"""The OpenAI routes against the fake engine, through the official SDK and raw HTTP."""
import asyncio
import json

import openai
import pytest

from pagedserve.common.tokenizer import Tokenizer
from tests.gateway.fake_engine import CACHED_TOKENS, CHAT_TEMPLATE, LEAK, MAX_MODEL_LEN, MODEL, REPLY, serve_live_gateway

CHAT = [{"role": "user", "content": "Say hello"}]


async def test_models_list_and_get(client, http, base_url):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "pagedserve"
    model = await client.models.retrieve(MODEL)
    assert model.id == MODEL and model.model_extra["max_model_len"] == MAX_MODEL_LEN
    async with http.get(f"{base_url}/v1/models/nope") as r:
        assert r.status == 404
        assert (await r.json())["error"]["message"] == "The model `nope` does not exist."


async def test_chat_non_stream(client, engine):
    reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == MODEL and isinstance(reply.created, int)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.refusal is None and choice.logprobs is None
    assert REPLY.startswith(choice.message.content)
    assert reply.usage.completion_tokens == 10
    assert reply.usage.prompt_tokens == len(engine.requests[0].prompt_token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 10
    # cached_tokens tells whether anyone sent the prefix lately: only with --enable-prompt-tokens-details.
    assert reply.usage.prompt_tokens_details is None
    assert engine.requests[0].params.max_tokens == 10 and engine.requests[0].cache_salt == ""


async def test_cached_tokens_only_with_prompt_tokens_details_and_the_salt_reaches_the_engine(serve, engine):
    base = await serve(prompt_tokens_details=True)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                                 extra_body={"cache_salt": "tenant-a"})
    assert reply.usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS
    reply = await client.completions.create(model=MODEL, prompt="Once", max_tokens=2,
                                            extra_body={"cache_salt": "tenant-b"})
    assert [r.cache_salt for r in engine.requests] == ["tenant-a", "tenant-b"]
    for salt in ("", "x" * 257):
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            await client.completions.create(model=MODEL, prompt="Once", max_tokens=2, extra_body={"cache_salt": salt})


async def test_chat_stream_equals_non_stream(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)
    whole = await client.chat.completions.create(**args)
    chunks = [c async for c in await client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True})]
    *chunks, last = chunks
    assert last.choices == [] and last.usage == whole.usage
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert len({(c.id, c.created, c.model, c.object) for c in chunks}) == 1
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].model == MODEL
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in chunks)
    assert "😀" in text and "🎉" in text


async def test_completions_non_stream_and_stream(client, loose_client):
    whole = await client.completions.create(model=MODEL, prompt="Once", max_tokens=20)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].finish_reason == "length"
    chunks = [c async for c in await loose_client.completions.create(
        model=MODEL, prompt="Once", max_tokens=20, stream=True)]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.usage.completion_tokens == 20


async def test_completion_prompt_forms_and_echo(client, tokenizer, engine):
    ids = tokenizer.encode("Once upon")
    for prompt in (["Once upon", "a time"], ids, [ids, ids[:2]]):
        reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
        assert sorted(c.index for c in reply.choices) == list(range(len(reply.choices)))
    assert list(engine.requests[-2].prompt_token_ids) == ids
    echoed = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith("Once upon") and len(echoed.choices[0].text) > 9


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http, base_url, tokenizer, engine):
    ids = tokenizer.encode("Once upon a time there was")
    body = {"prompt": "Once upon a time there was", "max_tokens": 2, "echo": True, "truncate_prompt_tokens": 3}
    async with http.post(f"{base_url}/v1/completions", json=body) as r:
        reply = await r.json()
    assert list(engine.requests[-1].prompt_token_ids) == ids[-3:]
    assert reply["usage"]["prompt_tokens"] == 3
    # Echo shows what the model read.
    assert reply["choices"][0]["text"].startswith(tokenizer.decode(ids[-3:]))
    async with http.post(f"{base_url}/v1/chat/completions",
                         json={"messages": CHAT, "max_tokens": 2, "truncate_prompt_tokens": 4}) as r:
        assert r.status == 200
    assert list(engine.requests[-1].prompt_token_ids) == tokenizer.encode(
        tokenizer.apply_chat_template(CHAT), add_special_tokens=False)[-4:]
    async with http.post(f"{base_url}/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": -1,
                                                            "max_tokens": 2}) as r:
        assert r.status == 200 and list(engine.requests[-1].prompt_token_ids) == ids
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        async with http.post(f"{base_url}/v1/completions", json={**body, "truncate_prompt_tokens": bad}) as r:
            error = (await r.json())["error"]
        assert (r.status, error["param"]) == (400, "truncate_prompt_tokens"), bad


async def test_raw_sse_framing_and_include_usage(http, base_url):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(f"{base_url}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream"
        raw = (await r.read()).decode()
    assert "\r" not in raw and raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    usage = [c for c in chunks if c["usage"] is not None]
    assert len(usage) == 1 and usage[0] is chunks[-1] and usage[0]["choices"] == []
    assert usage[0]["usage"]["completion_tokens"] == 5
    assert "prompt_tokens_details" not in usage[0]["usage"]
    assert all("usage" in c for c in chunks)


async def test_continuous_usage_stats_put_each_choices_usage_so_far_on_its_chunks(http, base_url, engine):
    cases = (("chat/completions", {"messages": CHAT}), ("completions", {"prompt": ["Once upon", "A"]}))
    for route, prompt in cases:
        body = {"model": MODEL, **prompt, "max_tokens": 4, "n": 2, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        async with http.post(f"{base_url}/v1/{route}", json=body) as r:
            raw = (await r.read()).decode()
        *chunks, last = [json.loads(e[6:]) for e in raw.split("\n\n")[:-2]]
        prompts = [len(q.prompt_token_ids) for q in engine.requests[-4 if route == "completions" else -2:]]
        seen = {}
        for chunk in chunks:
            usage, (choice,) = chunk["usage"], chunk["choices"]
            done = seen.get(choice["index"], 0)
            assert usage["prompt_tokens"] == prompts[choice["index"]] and done <= usage["completion_tokens"] <= 4
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            seen[choice["index"]] = usage["completion_tokens"]
        assert seen == {i: 4 for i in range(len(prompts))}
        openings = [c for c in chunks if c["choices"][0].get("delta", {}).get("role")]
        assert len(openings) == (2 if route == "chat/completions" else 0)
        assert all(c["usage"]["completion_tokens"] == 0 for c in openings)
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4 * len(prompts)


async def test_return_token_ids_puts_the_prompts_and_outputs_ids_beside_the_text(http, base_url, engine, tokenizer):
    async def post(route: str, body: dict) -> list[dict] | dict:
        async with http.post(f"{base_url}/v1/{route}", json={"model": MODEL, "max_tokens": 6, **body}) as r:
            if not body.get("stream"):
                return await r.json()
            return [json.loads(e[6:]) for e in (await r.read()).decode().split("\n\n")[:-2]]

    chat = await post("chat/completions", {"messages": CHAT, "return_token_ids": True})
    assert chat["prompt_token_ids"] == list(engine.requests[-1].prompt_token_ids)
    ids = chat["choices"][0]["token_ids"]
    # The sixth token ends inside a character, which the text holds back at a length stop.
    assert len(ids) == 6 and tokenizer.decode(ids).rstrip("\ufffd") == chat["choices"][0]["message"]["content"]
    chunks = await post("chat/completions", {"messages": CHAT, "return_token_ids": True, "stream": True})
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == ids

    whole = await post("completions", {"prompt": ["Once upon", "A"], "return_token_ids": True})
    prompts = [list(r.prompt_token_ids) for r in engine.requests[-2:]]
    assert [c["prompt_token_ids"] for c in whole["choices"]] == prompts
    assert all(tokenizer.decode(c["token_ids"]).rstrip("\ufffd") == c["text"] for c in whole["choices"])
    chunks = await post("completions", {"prompt": ["Once upon", "A"], "return_token_ids": True, "stream": True})
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == prompts[i] and all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == whole["choices"][i]["token_ids"]

    plain = await post("completions", {"prompt": "Once upon"})
    assert not {"prompt_token_ids", "token_ids"} & plain["choices"][0].keys()
    plain = await post("chat/completions", {"messages": CHAT})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


async def test_include_reasoning_false_leaves_the_thinking_out(serve, engine, tokenizer):
    url = await serve(reasoning_parser="qwen3")
    engine.reply = tokenizer.encode("<think>Plan it.</think>The answer.", add_special_tokens=False)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    args = dict(model=MODEL, messages=CHAT, max_tokens=len(engine.reply))
    for shown in (True, False):
        whole = await client.chat.completions.create(**args, extra_body={"include_reasoning": shown})
        chunks = [c async for c in await client.chat.completions.create(
            **args, stream=True, extra_body={"include_reasoning": shown})]
        deltas = [c.choices[0].delta for c in chunks]
        assert whole.choices[0].message.content == "".join(d.content or "" for d in deltas) == "The answer."
        thinking = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
        assert (whole.choices[0].message.model_extra.get("reasoning"), thinking) == (
            ("Plan it.", "Plan it.") if shown else (None, ""))
        assert chunks[-1].choices[0].finish_reason == "length"


async def test_force_include_usage_ends_every_stream_with_its_usage(http, serve):
    url = await serve(force_include_usage=True)
    for route, prompt in (("chat/completions", {"messages": CHAT}), ("completions", {"prompt": "Once"})):
        # As vLLM's: forced usage is included usage, so continuous_usage_stats applies.
        for continuous in (False, True):
            options = {"stream_options": {"include_usage": False, "continuous_usage_stats": True}} if continuous else {}
            async with http.post(f"{url}/v1/{route}", json={**prompt, "max_tokens": 3, "stream": True, **options}) as r:
                *chunks, last = [json.loads(e[6:]) for e in (await r.read()).decode().split("\n\n")[:-2]]
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
            assert all((c["usage"] is not None) == continuous for c in chunks)


async def test_response_role_names_new_turns_and_a_continued_turn_keeps_its_role(http, serve):
    url = await serve(response_role="bot")
    begun = [*CHAT, {"role": "assistant", "content": "Hi"}]
    cases = (({"messages": CHAT}, "bot"),
             ({"messages": begun, "add_generation_prompt": False, "continue_final_message": True}, "assistant"),
             ({"messages": CHAT, "add_generation_prompt": False}, "user"))
    for body, role in cases:
        async with http.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 2}) as r:
            assert (await r.json())["choices"][0]["message"]["role"] == role
        async with http.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 2, "stream": True}) as r:
            first = json.loads((await r.read()).decode().split("\n\n")[0][6:])
        assert first["choices"][0]["delta"]["role"] == role


PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}S:{{ m.content }}{% else %}"
                  "{% for p in m.content %}P:{{ p.text }}{% endfor %}{% endif %}</{{ m.role }}>{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")


async def test_content_parts_reach_a_template_that_loops_over_them_as_parts(http, engine, tokenizer_dir):
    tokenizer = Tokenizer.from_dir(tokenizer_dir, chat_template=PARTS_TEMPLATE)
    assert tokenizer.content_format() == "openai"
    chat = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hal"}, {"type": "text", "text": "lo"}]}]
    continued = {"messages": chat, "add_generation_prompt": False, "continue_final_message": True}
    prompts = {}
    for form in ("auto", "string", "openai"):
        runner, url = await serve_live_gateway(tokenizer, engine.address, content_format=form)
        try:
            for name, body in (("new", {"messages": chat[:1]}), ("continued", continued)):
                async with http.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 1}) as r:
                    assert r.status == 200, await r.text()
                prompts[form, name] = tokenizer.decode(list(engine.requests[-1].prompt_token_ids))
        finally:
            await runner.cleanup()
    assert prompts["auto", "new"] == prompts["openai", "new"] == "<user>P:aP:b</user><assistant>"
    assert prompts["string", "new"] == "<user>S:a\nb</user><assistant>"
    # The continued message ends with its last part, as transformers continues a list of parts.
    assert prompts["auto", "continued"] == "<user>P:aP:b</user><assistant>P:HalP:lo"
    assert prompts["string", "continued"] == "<user>S:a\nb</user><assistant>S:Hal\nlo"


async def test_a_request_template_that_loops_over_content_gets_parts(http, engine, tokenizer):
    runner, url = await serve_live_gateway(tokenizer, engine.address, trust_request_chat_template=True)
    chat = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    try:
        for template, expected in ((PARTS_TEMPLATE, "<user>P:aP:b</user><assistant>"),
                                   (CHAT_TEMPLATE, tokenizer.apply_chat_template([{"role": "user", "content": "a\nb"}]))):
            body = {"messages": chat, "max_tokens": 1, "chat_template": template}
            async with http.post(f"{url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
            assert tokenizer.decode(list(engine.requests[-1].prompt_token_ids), False) == expected
    finally:
        await runner.cleanup()


async def test_documents_reach_the_template_and_add_special_tokens_adds_bos(http, engine, tokenizer_dir):
    template = "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}" + CHAT_TEMPLATE
    tokenizer = Tokenizer.from_dir(tokenizer_dir, chat_template=template)
    runner, url = await serve_live_gateway(tokenizer, engine.address)
    sent = []
    try:
        for extra in ({"documents": [{"title": "A", "text": "one"}, {"title": "B", "text": "two"}]},
                      {"add_special_tokens": True}, {}):
            async with http.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, **extra}) as r:
                assert r.status == 200, await r.text()
            sent.append(list(engine.requests[-1].prompt_token_ids))
    finally:
        await runner.cleanup()
    documents, with_bos, plain = sent
    assert tokenizer.decode(documents, False).startswith("[A: one][B: two]")
    # The template writes BOS already, so the tokenizer's makes two, as in vLLM.
    assert with_bos == [tokenizer.bos_token_id, *plain]
    assert tokenizer.decode(plain, False) == tokenizer.apply_chat_template(CHAT)


async def test_reasoning_effort_reaches_the_chat_template_unless_its_kwargs_set_it(http, engine, tokenizer_dir):
    tokenizer = Tokenizer.from_dir(tokenizer_dir, chat_template="{{ reasoning_effort }}|" + CHAT_TEMPLATE)
    runner, url = await serve_live_gateway(tokenizer, engine.address)
    sent = []
    try:
        for extra in ({"reasoning_effort": "low"}, {"reasoning_effort": "low", "chat_template_kwargs": {
                "reasoning_effort": "high"}}, {}):
            async with http.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, **extra}) as r:
                assert r.status == 200
            sent.append(tokenizer.decode(list(engine.requests[-1].prompt_token_ids)).split("|")[0])
    finally:
        await runner.cleanup()
    assert sent == ["low", "high", ""]


async def test_no_usage_key_without_include_usage(http, base_url):
    body = {"messages": CHAT, "max_tokens": 3, "stream": True, "stream_options": {}}
    async with http.post(f"{base_url}/v1/chat/completions", json=body) as r:
        raw = (await r.read()).decode()
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n")[:-2]]
    assert chunks and all("usage" not in c for c in chunks)


async def test_stop_string(client, engine):
    reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40,
                                                 stop=["quick", "never"])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "quick"
    assert choice.message.content == REPLY[:REPLY.index("quick")]
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, stop="quick", stream=True)]
    deltas = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(deltas) == choice.message.content
    assert not any("qu" in d for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "stop"
    await engine.wait_cancelled(2)
    assert len(engine.cancelled) == 2


async def test_stop_token_id(client, tokenizer):
    stop_id = tokenizer.encode(REPLY, add_special_tokens=False)[3]
    reply = await client.completions.create(model=MODEL, prompt="x", max_tokens=30,
                                            extra_body={"stop_token_ids": [stop_id]})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].model_extra["stop_reason"] == stop_id
    assert reply.usage.completion_tokens == 4
    # The stop token counts, but its text is left out unless include_stop_str_in_output, as in vLLM.
    ids = tokenizer.encode(REPLY, add_special_tokens=False)[:4]
    assert reply.choices[0].text == tokenizer.decode(ids[:3]).rstrip("\ufffd")
    kept = await client.completions.create(model=MODEL, prompt="x", max_tokens=30, extra_body={
        "stop_token_ids": [stop_id], "include_stop_str_in_output": True})
    assert kept.choices[0].text == tokenizer.decode(ids)


async def test_largest_seed_wraps_for_the_second_choice(client, engine):
    await client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=2, seed=2**63 - 1)
    assert sorted(r.params.seed for r in engine.requests) == [-2**63, 2**63 - 1]


async def test_n_choices_fan_out(client, engine):
    reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2, seed=7)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens == len(engine.requests[0].prompt_token_ids)
    assert sorted(r.params.seed for r in engine.requests) == [7, 8]
    ids = sorted(r.request_id for r in engine.requests)
    assert ids[0].endswith("-0") and ids[1].endswith("-1") and ids[0][:-2] == ids[1][:-2]
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, n=2, stream=True)]
    finals = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finals) == [0, 1]
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
             for i in (0, 1)]
    assert texts[0] == texts[1] == reply.choices[0].message.content


async def test_max_completion_tokens_wins_and_default_fills_context(client, engine):
    await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=9,
                                         max_completion_tokens=3)
    assert engine.requests[-1].params.max_tokens == 3
    reply = await client.completions.create(model="", prompt="Hi", max_tokens=None)
    assert not engine.requests[-1].params.HasField("max_tokens")
    assert reply.usage.completion_tokens == MAX_MODEL_LEN - reply.usage.prompt_tokens


async def test_context_overflow(client):
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=[1] * 200, max_tokens=100)
    assert e.value.body["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested 100 "
        "output tokens and your prompt contains at least 200 input tokens, for a total of at least 300 "
        "tokens. Please reduce the length of the input prompt or the number of requested output tokens.")


async def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert e.value.body == {"message": "The model `gpt-4` does not exist.", "type": "invalid_request_error",
                            "param": "model", "code": "model_not_found"}


async def test_request_id_echoed_once_and_forwarded(http, base_url, engine):
    body = {"messages": CHAT, "max_tokens": 2}
    async with http.post(f"{base_url}/v1/chat/completions", json=body,
                         headers={"X-Request-Id": "abc-123"}) as r:
        assert r.headers.getall("X-Request-Id") == ["abc-123"]
    assert engine.metadata[-1]["x-request-id"] == "abc-123"
    async with http.post(f"{base_url}/v1/chat/completions", json={**body, "stream": True}) as r:
        assert len(r.headers.getall("X-Request-Id")) == 1
        await r.read()
    async with http.get(f"{base_url}/nowhere") as r:
        assert r.status == 404 and len(r.headers.getall("X-Request-Id")) == 1
        assert set((await r.json())["error"]) == {"message", "type", "param", "code"}


async def test_health(http, base_url, dead_engine_url):
    async with http.get(f"{base_url}/health") as r:
        assert r.status == 200
    async with http.get(f"{dead_engine_url}/health") as r:
        assert r.status == 503
        assert (await r.json())["error"]["type"] == "service_unavailable"
    async with http.post(f"{dead_engine_url}/v1/chat/completions", json={"messages": CHAT}) as r:
        assert r.status == 503 and "127.0.0.1" not in await r.text()


async def test_errors_never_carry_paths_or_addresses(http, base_url, dead_engine_url, engine):
    replies = []
    for url in (base_url, dead_engine_url):
        for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                                   ("POST", "/v1/chat/completions", {"messages": CHAT}),
                                   ("POST", "/tokenize", {"prompt": "x"}), ("GET", "/nowhere", None)):
            async with http.request(method, url + path, json=body) as r:
                replies.append((r.status, await r.text()))
    engine.fail_after = 0
    async with http.post(f"{base_url}/v1/completions", json={"prompt": "x"}) as r:
        replies.append((r.status, await r.text()))
    errors = [text for status, text in replies if status >= 400]
    assert len(errors) == 7 and not [e for e in errors if LEAK.search(e)]


async def test_mid_stream_failure_sends_error_then_done(http, base_url, engine):
    engine.fail_after = 3
    body = {"prompt": "x", "max_tokens": 20, "stream": True}
    async with http.post(f"{base_url}/v1/completions", json=body) as r:
        raw = (await r.read()).decode()
    events = raw.split("\n\n")[:-1]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["type"] == "internal_server_error" and "/secret" not in raw


async def test_failure_before_first_token_is_an_http_error(client, engine):
    engine.fail_after = 0
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True)


async def test_concurrent_requests_share_one_engine_call(client, engine):
    replies = await asyncio.gather(*[client.completions.create(model=MODEL, prompt="Hi", max_tokens=8)
                                     for _ in range(20)])
    assert len({r.choices[0].text for r in replies}) == 1
    assert len(engine.requests) == 20 and engine.stream_calls == 1


async def test_the_models_generation_config_fills_omitted_sampling_options(serve, engine):
    url = await serve(sampling_defaults={"temperature": 0.25, "top_k": 7})
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0) as client:
        await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=1.0)
    omitted, given = engine.requests[-2].params, engine.requests[-1].params
    assert (omitted.temperature, omitted.top_k) == (0.25, 7)
    assert (given.temperature, given.top_k) == (1.0, 7)


async def test_the_generation_configs_max_new_tokens_is_a_default_and_its_cap_a_bound(serve, engine):
    for cap in (None, 5):
        url = await serve(sampling_defaults={"max_tokens": 5}, max_tokens_cap=cap)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0) as client:
            for asked in (None, 3, 50):
                await client.completions.create(model=MODEL, prompt="Hi", max_tokens=asked)
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                     max_completion_tokens=asked)
    assert [r.params.max_tokens for r in engine.requests] == [5, 5, 3, 3, 50, 50] + [5, 5, 3, 3, 5, 5]
