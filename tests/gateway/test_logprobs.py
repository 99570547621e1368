"""Logprobs and penalties through the gateway: what reaches the engine, and the OpenAI shapes of
the fake engine's logprobs (fake_engine.fake_logprobs) in chat and completions, streamed or not."""
import json

import pytest

from pagedserve.gateway.logprobs import decode_prompt
from pagedserve.v1 import engine_pb2 as pb
from tests.gateway.fake_engine import MODEL, REPLY

CHAT = [{"role": "user", "content": "Say hello"}]


def expected_tokens(tokenizer, n: int) -> list[str]:
    reply = tokenizer.encode(REPLY, add_special_tokens=False)
    return [tokenizer.decode([t], skip_special_tokens=False) for t in reply[:n]]


def check_chat_entries(entries, tokenizer, n: int, k: int) -> None:
    assert [e.token for e in entries] == expected_tokens(tokenizer, n)
    for i, e in enumerate(entries):
        assert abs(e.logprob + 0.01 * (i + 1)) < 1e-6
        assert e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == k
        if k:
            assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        top = [t.logprob for t in e.top_logprobs]
        assert top == sorted(top, reverse=True)
        assert all(t.bytes == list(t.token.encode()) for t in e.top_logprobs)


async def test_chat_logprobs_non_stream_and_stream(client, engine, tokenizer):
    args = dict(model=MODEL, messages=CHAT, max_tokens=12, logprobs=True, top_logprobs=3)
    whole = await client.chat.completions.create(**args)
    assert engine.requests[-1].params.logprobs == 3
    logprobs = whole.choices[0].logprobs
    assert logprobs.refusal is None
    check_chat_entries(logprobs.content, tokenizer, 12, 3)
    chunks = [c async for c in await client.chat.completions.create(**args, stream=True)]
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == logprobs.content
    assert chunks[0].choices[0].logprobs is None


async def test_chat_logprobs_without_top_logprobs(client, engine, tokenizer):
    reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=True)
    assert engine.requests[-1].params.logprobs == 0
    check_chat_entries(reply.choices[0].logprobs.content, tokenizer, 4, 0)


async def test_no_logprobs_unless_asked(client, engine):
    reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=False)
    assert reply.choices[0].logprobs is None
    assert not engine.requests[-1].params.HasField("logprobs")


def check_completion_logprobs(logprobs: dict, tokenizer, n: int, k: int) -> None:
    tokens = expected_tokens(tokenizer, n)
    assert logprobs["tokens"] == tokens
    for i, (lp, top) in enumerate(zip(logprobs["token_logprobs"], logprobs["top_logprobs"])):
        assert abs(lp + 0.01 * (i + 1)) < 1e-6
        # The k top tokens, the sampled one (the most likely here) among them; equal texts merge.
        assert top[tokens[i]] == lp and len(top) <= k
    offsets = [0]
    for token in tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets


async def test_completion_logprobs_non_stream_and_stream(http, base_url, engine, tokenizer):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 12, "logprobs": 2}
    async with http.post(f"{base_url}/v1/completions", json=body) as r:
        whole = (await r.json())["choices"][0]["logprobs"]
    assert engine.requests[-1].params.logprobs == 2
    check_completion_logprobs(whole, tokenizer, 12, 2)
    async with http.post(f"{base_url}/v1/completions", json={**body, "stream": True}) as r:
        raw = (await r.read()).decode()
    chunks = [json.loads(e[6:])["choices"][0]["logprobs"] for e in raw.split("\n\n")[:-2]]
    joined = {key: [v for c in chunks for v in c[key]] for key in whole}
    assert joined == whole


async def test_completion_logprobs_go_to_twenty_as_in_vllm(http, base_url, engine, tokenizer):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 3, "logprobs": 20}
    async with http.post(f"{base_url}/v1/completions", json=body) as r:
        assert r.status == 200
        whole = (await r.json())["choices"][0]["logprobs"]
    assert engine.requests[-1].params.logprobs == 20
    check_completion_logprobs(whole, tokenizer, 3, 20)


async def test_logprobs_go_to_the_engines_max_logprobs_and_no_further(serve, http, engine):
    engine.max_logprobs = 25
    url = await serve()
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 25}
    async with http.post(f"{url}/v1/chat/completions", json=chat) as r:
        assert r.status == 200
    assert engine.requests[-1].params.logprobs == 25
    completion = {"model": MODEL, "prompt": "Once", "max_tokens": 2}
    for path, body, param in (("chat/completions", {**chat, "top_logprobs": 26}, "top_logprobs"),
                              ("completions", {**completion, "logprobs": 26}, "logprobs"),
                              ("completions", {**completion, "prompt_logprobs": 26}, "prompt_logprobs")):
        async with http.post(f"{url}/v1/{path}", json=body) as r:
            error = (await r.json())["error"]
        assert r.status == 400 and error["param"] == param
        assert error["message"] == f"{param} must be in [0, 25] (the server's --max-logprobs), got 26."


async def test_tokens_as_token_ids_by_request_or_by_the_server_flag(serve, http, tokenizer):
    ids = tokenizer.encode(REPLY, add_special_tokens=False)[:4]
    named = [f"token_id:{t}" for t in ids]
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    completion = {"model": MODEL, "prompt": "Once", "max_tokens": 4, "logprobs": 2}

    async def tokens(url: str, **extra) -> tuple[list[str], list[str], list[str]]:
        async with http.post(f"{url}/v1/chat/completions", json={**chat, **extra}) as r:
            content = (await r.json())["choices"][0]["logprobs"]["content"]
        async with http.post(f"{url}/v1/completions", json={**completion, **extra}) as r:
            legacy = (await r.json())["choices"][0]["logprobs"]
        assert all(e["bytes"] == list(e["token"].encode()) for e in content)
        tops = [t["token"] for e in content for t in e["top_logprobs"]] + [t for d in legacy["top_logprobs"] for t in d]
        return [e["token"] for e in content], legacy["tokens"], tops

    plain, flagged = await serve(), await serve(return_tokens_as_token_ids=True)
    chat_tokens, legacy_tokens, tops = await tokens(plain, return_tokens_as_token_ids=True)
    assert chat_tokens == legacy_tokens == named and all(t.startswith("token_id:") for t in tops)
    assert (await tokens(flagged))[:2] == (named, named)
    assert (await tokens(flagged, return_tokens_as_token_ids=False))[:2] == (expected_tokens(tokenizer, 4),) * 2
    assert (await tokens(plain))[:2] == (expected_tokens(tokenizer, 4),) * 2


def test_prompt_tokens_as_token_ids(tokenizer):
    """Echoed prompts and prompt_logprobs name their tokens as the output's do."""
    entry = pb.TokenLogprobs(logprob=-0.5, rank=2, top_token_ids=[7], top_logprobs=[-0.1])
    first, second = decode_prompt(tokenizer, [5, 6], [entry], as_ids=True)
    assert (first.token, first.logprob, second.token, second.top) == ("token_id:5", None, "token_id:6",
                                                                      [(7, "token_id:7", pytest.approx(-0.1))])
    assert decode_prompt(tokenizer, [5, 6], [entry])[1].token == tokenizer.decode([6], skip_special_tokens=False)


async def test_completion_logprobs_parse_in_the_sdk(client, tokenizer):
    reply = await client.completions.create(model=MODEL, prompt="Once", max_tokens=5, logprobs=1)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == expected_tokens(tokenizer, 5) and len(logprobs.top_logprobs) == 5


async def test_penalties_reach_the_engine(client, engine):
    def penalties() -> tuple[float, float, float]:
        p = engine.requests[-1].params
        return p.presence_penalty, p.frequency_penalty, p.repetition_penalty

    await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, presence_penalty=0.5,
                                         frequency_penalty=-1.5, extra_body={"repetition_penalty": 1.25})
    assert penalties() == (0.5, -1.5, 1.25)
    await client.completions.create(model=MODEL, prompt="Once", max_tokens=2)
    assert penalties() == (0.0, 0.0, 1.0)
