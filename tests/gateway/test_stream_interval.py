"""--stream-interval: fewer, larger chunks with the same text."""
import json

from tests.gateway.fake_engine import MODEL

BODY = {"model": MODEL, "prompt": "Once", "max_tokens": 23, "stream": True, "ignore_eos": True}


async def stream_texts(http, url: str) -> list[str]:
    async with http.post(f"{url}/v1/completions", json=BODY) as r:
        assert r.status == 200
        body = (await r.read()).decode()
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0]["text"] for e in events[:-1]]


async def test_chunks_carry_the_interval_and_the_same_text(http, serve):
    every = await stream_texts(http, await serve())
    grouped = await stream_texts(http, await serve(stream_interval=5))
    assert "".join(grouped) == "".join(every)
    # The first token at once, then 22 tokens in groups of at least 5: at most 1 + 5 chunks (text
    # held back only merges them further).
    assert grouped[0] == every[0]
    assert len(grouped) <= 6 < len(every)
