"""use_beam_search: the search on a small model whose logprobs are a table (where greedy decoding
misses the best continuation), and through the gateway on the fake engine: n whole choices, usage,
logprobs, a stream, and the 400s for what a search cannot honour."""
import json

import pytest

from pagedserve.gateway.beam_search import Search, search
from pagedserve.gateway.logprobs import TokenLogprob

A, B, C, D, EOS = 1, 2, 3, 4, 9
# Next-token logprobs by the last token: greedy takes A then C (-0.4 - 1.5), a beam of two finds B
# then C (-0.6 - 0.1). After C, ending is likely; after D nothing ends.
TABLE = {0: {A: -0.4, B: -0.6, D: -3.0}, A: {C: -1.5, EOS: -2.0, D: -2.5}, B: {C: -0.1, EOS: -3.0, D: -4.0},
         C: {EOS: -0.05, D: -3.5, A: -4.0}, D: {D: -0.01, A: -5.0, B: -6.0}}


async def table_step(beams):
    """Each beam's next-token top list from TABLE, most likely first."""
    tops = []
    for beam in beams:
        ranked = sorted(TABLE[beam.tokens[-1]].items(), key=lambda kv: -kv[1])
        tops.append(TokenLogprob(ranked[0][0], str(ranked[0][0]), ranked[0][1], 1,
                                 [(t, str(t), lp) for t, lp in ranked]))
    return tops


def results(beams):
    return [(b.tokens[1:], round(b.logprob, 4), b.finish_reason) for b in beams]


async def test_a_beam_of_two_finds_what_greedy_misses():
    beams = await search([0], Search(width=2, max_tokens=3, eos=EOS), table_step)
    # Ranked by logprob / length (prompt included, the end of text not).
    assert results(beams) == [([B, C, EOS], -0.75, "stop"), ([A, C, EOS], -1.95, "stop")]
    greedy = await search([0], Search(width=1, max_tokens=3, eos=EOS), table_step)
    assert results(greedy) == [([A, C, EOS], -1.95, "stop")]


async def test_ignore_eos_and_allowed_tokens():
    # With ignore_eos the end of text is a token like any other: both beams run to max_tokens.
    endless = await search([0], Search(width=2, max_tokens=3, eos=EOS, ignore_eos=True), table_step)
    assert results(endless) == [([B, C, EOS], -0.75, "length"), ([A, C, EOS], -1.95, "length")]
    # allowed_token_ids {A, D}: C and the end of text are never chosen.
    only = await search([0], Search(width=2, max_tokens=2, eos=EOS, allowed=frozenset({A, D})), table_step)
    assert results(only) == [([A, D], -2.9, "length"), ([D, D], -3.01, "length")]


async def test_length_penalty_decides_between_short_and_long_endings():
    # Width 3 over 4 tokens completes [A, EOS] (-2.4), [B, C, EOS] (-0.75) and [A, C, EOS] (-1.95)
    # among others; a penalty of 0 ranks by summed logprob, one of 2 divides by length squared.
    by_sum = await search([0], Search(width=3, max_tokens=4, eos=EOS, length_penalty=0.0), table_step)
    assert [round(b.logprob, 4) for b in by_sum] == sorted((round(b.logprob, 4) for b in by_sum), reverse=True)
    for penalty in (0.0, 1.0, 2.0):
        ranked = await search([0], Search(width=3, max_tokens=4, eos=EOS, length_penalty=penalty), table_step)
        scores = [b.logprob / (len(b.tokens) - (b.tokens[-1] == EOS)) ** penalty for b in ranked]
        assert scores == sorted(scores, reverse=True) and ranked[0].tokens == [0, B, C, EOS]


async def post(http, url: str, path: str, body: dict):
    async with http.post(url + path, json=body) as r:
        return r.status, await r.text()


async def test_completions_return_n_whole_beams(http, base_url, engine, tokenizer):
    # The fake engine's one-token answer is reply[0] at -0.01, then the ids after it, each 1 less likely.
    first = engine.reply[0]
    status, raw = await post(http, base_url, "/v1/completions", {
        "prompt": "Hi", "use_beam_search": True, "n": 2, "max_tokens": 3, "logprobs": 1})
    assert status == 200, raw
    body = json.loads(raw)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices][0] == tokenizer.decode([first] * 3)
    assert all(c["finish_reason"] == "length" for c in choices) and len(choices) == 2
    # Round 2 keeps [f, f] and, of the two at -1.02, the first beam's [f, f + 1]; round 3 extends both.
    assert choices[0]["logprobs"]["token_logprobs"] == pytest.approx([-0.01] * 3)
    assert choices[1]["text"] == tokenizer.decode([first, first, first + 1])
    assert choices[1]["logprobs"]["token_logprobs"] == pytest.approx([-0.01, -0.01, -1.01])
    assert body["usage"]["completion_tokens"] == 6
    # Three rounds of one request per live beam: one, then two, then two.
    rounds = [r for r in engine.requests if r.params.max_tokens == 1]
    assert len(rounds) == 5 and all(r.params.logprobs == 4 and r.params.temperature == 0 for r in rounds)


async def test_a_beam_that_reaches_the_end_of_text_stops(http, base_url, engine, tokenizer):
    engine.reply = [engine.eos - 1] + engine.reply
    status, raw = await post(http, base_url, "/v1/completions", {
        "prompt": "Hi", "use_beam_search": True, "n": 2, "max_tokens": 4})
    choices = sorted(json.loads(raw)["choices"], key=lambda c: c["index"])
    # The end of text is each round's second likeliest token, so every round completes a beam; the
    # best beam runs on, and the best completed one is the longest (its -1.04 over the most tokens).
    assert [c["finish_reason"] for c in choices] == ["length", "stop"]
    status, raw = await post(http, base_url, "/v1/completions", {
        "prompt": "Hi", "use_beam_search": True, "n": 2, "max_tokens": 4, "logprobs": 0})
    stopped = sorted(json.loads(raw)["choices"], key=lambda c: c["index"])[1]["logprobs"]
    assert stopped["token_logprobs"] == pytest.approx([-0.01, -0.01, -0.01, -1.01])
    assert stopped["tokens"][-1] == tokenizer.decode([engine.eos], skip_special_tokens=False)


async def test_chat_streams_the_beams_whole(http, base_url, engine, tokenizer):
    status, raw = await post(http, base_url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "use_beam_search": True, "n": 3, "max_tokens": 2,
        "stream": True})
    assert status == 200
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert sorted(texts) == [0, 1, 2] and texts[0] == tokenizer.decode([engine.reply[0]] * 2)


@pytest.mark.parametrize("body, param", [
    ({"n": 11}, "n"),
    ({"response_format": {"type": "json_object"}}, "use_beam_search"),
    ({"logit_bias": {"5": 1}}, "use_beam_search"),
])
async def test_what_a_search_cannot_honour_is_a_400(http, base_url, engine, body, param):
    status, raw = await post(http, base_url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "use_beam_search": True, "max_tokens": 2, **body})
    assert status == 400 and json.loads(raw)["error"]["param"] == param
    assert engine.requests == []
