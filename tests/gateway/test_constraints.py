"""What each way of asking for a constraint, a forced tool call, logit_bias and prompt logprobs
sends to the engine (the fake engine records the GenerateRequest)."""
import json
import shutil

import pytest
from tokenizers import Tokenizer as RustTokenizer

from pagedserve.common.sampling_params import sampling_from_proto
from pagedserve.common.tokenizer import Tokenizer
from tests.gateway.fake_engine import serve_live_gateway

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "g"}}]


async def sent(http, base_url, engine, path: str, body: dict):
    async with http.post(base_url + path, json={"max_tokens": 2, **body}) as r:
        assert r.status == 200, await r.text()
    return sampling_from_proto(engine.requests[-1].params)


@pytest.mark.parametrize("path, body, kind, value", [
    (CHAT, {"response_format": {"type": "json_object"}}, "json_object", True),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json", SCHEMA),
    (COMPLETIONS, {"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
    (COMPLETIONS, {"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
    (CHAT, {"guided_json": SCHEMA}, "json", SCHEMA),
    (COMPLETIONS, {"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
    (CHAT, {"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    (COMPLETIONS, {"guided_regex": "x+"}, "regex", "x+"),
])
async def test_every_spelling_reaches_the_engine(http, base_url, engine, path, body, kind, value):
    prompt = {"messages": MSG} if path == CHAT else {"prompt": "x"}
    constraint = (await sent(http, base_url, engine, path, {**prompt, **body})).structured_outputs
    got = getattr(constraint, kind)
    assert (json.loads(got) if kind == "json" else got) == value


async def test_forced_tool_choices_send_their_schemas(http, base_url, engine):
    named = await sent(http, base_url, engine, CHAT, {"messages": MSG, "tools": TOOLS,
                                                      "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert json.loads(named.structured_outputs.json) == SCHEMA
    required = await sent(http, base_url, engine, CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": "required",
                                                         "parallel_tool_calls": False})
    schema = json.loads(required.structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["f"], ["g"]]
    none = await sent(http, base_url, engine, CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": "none"})
    assert none.structured_outputs is None


async def test_logit_bias_and_prompt_logprobs_reach_the_engine(http, base_url, engine):
    params = await sent(http, base_url, engine, COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 250, "7": -3},
                                                              "echo": True, "logprobs": 2})
    assert params.logit_bias == {5: 100.0, 7: -3.0} and params.prompt_logprobs == 2
    params = await sent(http, base_url, engine, CHAT, {"messages": MSG, "prompt_logprobs": 1})
    assert params.prompt_logprobs == 1


async def test_allowed_token_ids_reach_the_engine_and_an_empty_or_foreign_one_is_a_400(http, base_url, engine):
    params = await sent(http, base_url, engine, CHAT, {"messages": MSG, "allowed_token_ids": [5, 9]})
    assert params.allowed_token_ids == [5, 9]
    assert (await sent(http, base_url, engine, COMPLETIONS, {"prompt": "x"})).allowed_token_ids is None
    for ids in ([], [-1], [5, 10**6]):
        async with http.post(base_url + COMPLETIONS, json={"prompt": "x", "allowed_token_ids": ids}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "allowed_token_ids"


async def test_bad_words_reach_the_engine_as_token_ids_as_text_starts_them_and_inside_it(http, base_url, engine,
                                                                                         tokenizer):
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    # In the tiny vocabulary " brown" is another first token and as many tokens as "brown"; " fox" is a
    # space token and "fox"'s, and " the" one token where "the" is two: only the first also goes.
    assert len(encode(" brown")) == len(encode("brown")) and encode(" brown")[0] != encode("brown")[0]
    assert encode(" fox")[1:] == encode("fox") and len(encode(" the")) != len(encode("the"))
    params = await sent(http, base_url, engine, CHAT, {"messages": MSG, "bad_words": ["brown", "fox", " the"]})
    assert params.bad_words_token_ids == [encode("brown"), encode(" brown"), encode("fox"), encode("the")]
    assert (await sent(http, base_url, engine, COMPLETIONS, {"prompt": "x"})).bad_words_token_ids is None


async def test_a_constraint_leaves_a_reasoning_models_thinking_free(http, engine, tokenizer_dir, tmp_path):
    # A vocabulary where </think> is one token, as a reasoning model's is; the tiny one's is not.
    shutil.copy(tokenizer_dir / "tokenizer_config.json", tmp_path)
    rust = RustTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    rust.add_special_tokens(["<think>", "</think>"])
    rust.save(str(tmp_path / "tokenizer.json"))
    thinking = Tokenizer.from_dir(tmp_path)
    body = {"messages": MSG, "guided_choice": ["a", "b"]}
    for tok, expected in ((thinking, [thinking.encode("</think>", add_special_tokens=False)[0]]),
                          (Tokenizer.from_dir(tokenizer_dir), None)):
        runner, url = await serve_live_gateway(tok, engine.address, reasoning_parser="qwen3")
        try:
            assert (await sent(http, url, engine, CHAT, body)).structured_outputs.reasoning_end_ids == expected
        finally:
            await runner.cleanup()
