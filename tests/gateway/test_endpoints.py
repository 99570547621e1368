"""vLLM's /tokenize and /detokenize, /version, and /health across a scheduler that starts late."""
import asyncio
import json
import time
from importlib.metadata import version

import grpc

from tests.gateway.fake_engine import FakeEngine, MAX_MODEL_LEN, MODEL, add_fake_engine, serve_gateway

CHAT = [{"role": "user", "content": "Grüße 😀"}]


async def _post(http, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


async def test_tokenize_prompt(http, base_url, tokenizer):
    status, reply = await _post(http, f"{base_url}/tokenize", {"model": MODEL, "prompt": "Hello wörld"})
    assert status == 200
    assert reply == {"count": len(reply["tokens"]), "max_model_len": MAX_MODEL_LEN,
                     "tokens": tokenizer.encode("Hello wörld")}
    assert reply["tokens"][0] == tokenizer.bos_token_id
    _, bare = await _post(http, f"{base_url}/tokenize",
                          {"prompt": "Hello wörld", "add_special_tokens": False})
    assert bare["tokens"] == reply["tokens"][1:]
    _, spelled = await _post(http, f"{base_url}/tokenize", {"prompt": "Hello wörld", "return_token_strs": True})
    assert spelled["tokens"] == reply["tokens"] and len(spelled["token_strs"]) == reply["count"]
    assert spelled["token_strs"][0] == tokenizer.bos_token
    # The vocabulary's own spellings: each maps back to its id.
    assert [tokenizer._tokenizer.token_to_id(s) for s in spelled["token_strs"]] == reply["tokens"]


async def test_tokenize_messages_matches_what_chat_sends(http, base_url, engine, tokenizer):
    _, reply = await _post(http, f"{base_url}/tokenize", {"messages": CHAT})
    status, _ = await _post(http, f"{base_url}/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    assert status == 200
    assert reply["tokens"] == list(engine.requests[-1].prompt_token_ids)
    assert reply["tokens"].count(tokenizer.bos_token_id) == 1
    _, bare = await _post(http, f"{base_url}/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert tokenizer.decode(reply["tokens"], False).endswith("<|assistant|>")
    assert not tokenizer.decode(bare["tokens"], False).endswith("<|assistant|>")


async def test_continue_final_message_ends_the_prompt_inside_the_last_message(http, base_url, engine, tokenizer):
    begun = [*CHAT, {"role": "assistant", "content": "Hallo, ich bin "}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    _, reply = await _post(http, f"{base_url}/tokenize", {"messages": begun, **flags})
    assert tokenizer.decode(reply["tokens"], False) == "<s><|user|>Grüße 😀\n<|assistant|>Hallo, ich bin "
    status, _ = await _post(http, f"{base_url}/v1/chat/completions", {"messages": begun, "max_tokens": 1, **flags})
    assert status == 200 and list(engine.requests[-1].prompt_token_ids) == reply["tokens"]
    _, whole = await _post(http, f"{base_url}/tokenize", {"messages": begun, "add_generation_prompt": False})
    assert tokenizer.decode(whole["tokens"], False).endswith("ich bin \n")
    for route in ("/tokenize", "/v1/chat/completions"):
        status, error = await _post(http, base_url + route, {"messages": begun, "continue_final_message": True})
        assert (status, error["error"]["param"]) == (400, "continue_final_message")
        assert "add_generation_prompt" in error["error"]["message"]
        empty = [*CHAT, {"role": "assistant", "content": " "}]
        status, error = await _post(http, base_url + route, {"messages": empty, **flags})
        assert (status, error["error"]["param"]) == (400, "messages") and "continued" in error["error"]["message"]


async def test_echo_starts_the_reply_with_the_assistants_begun_message(http, base_url, engine):
    begun = [*CHAT, {"role": "assistant", "content": "Hallo, "}]
    body = {"messages": begun, "max_tokens": 3, "continue_final_message": True, "add_generation_prompt": False}
    _, plain = await _post(http, f"{base_url}/v1/chat/completions", body)
    _, echoed = await _post(http, f"{base_url}/v1/chat/completions", {**body, "echo": True})
    assert echoed["choices"][0]["message"]["content"] == "Hallo, " + plain["choices"][0]["message"]["content"]
    async with http.post(f"{base_url}/v1/chat/completions", json={**body, "echo": True, "stream": True}) as r:
        chunks = [json.loads(e[6:]) for e in (await r.read()).decode().split("\n\n")[:-2]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and deltas[1]["content"] == "Hallo, "
    assert "".join(d.get("content") or "" for d in deltas) == echoed["choices"][0]["message"]["content"]
    # Only an assistant's final message is echoed.
    _, user_last = await _post(http, f"{base_url}/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "echo": True})
    assert user_last["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


async def test_detokenize_round_trip(http, base_url, tokenizer):
    _, tokens = await _post(http, f"{base_url}/tokenize", {"prompt": "Party 🎉 time"})
    status, reply = await _post(http, f"{base_url}/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert status == 200 and reply == {"prompt": "<s>Party 🎉 time"}


async def test_tokenize_errors(http, base_url):
    cases = [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
    ]
    for path, body, expected, param in cases:
        status, reply = await _post(http, base_url + path, body)
        assert (status, reply["error"]["param"]) == (expected, param), (path, body, reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"}


async def test_version(http, base_url):
    async with http.get(f"{base_url}/version") as r:
        assert r.status == 200 and await r.json() == {"version": version("pagedserve")}


async def test_health_turns_ready_when_the_scheduler_comes_up(http, tokenizer, unused_tcp_port):
    runner, url = await serve_gateway(tokenizer, f"127.0.0.1:{unused_tcp_port}")
    server = grpc.aio.server()
    try:
        for _ in range(3):
            async with http.get(f"{url}/health") as r:
                assert r.status == 503 and r.headers["Retry-After"]
            await asyncio.sleep(0.3)
        await add_fake_engine(server, FakeEngine(tokenizer))
        server.add_insecure_port(f"127.0.0.1:{unused_tcp_port}")
        await server.start()
        started = time.monotonic()
        while True:
            async with http.get(f"{url}/health") as r:
                if r.status == 200:
                    break
            assert time.monotonic() - started < 3, "the gateway did not see the scheduler come up"
            await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()
        await server.stop(0)
