"""Every kind of bad request gets a 4xx in OpenAI's error shape and never reaches the engine."""
import pytest

from pagedserve.common.sampling_params import OutOfRange, SamplingParams
from tests.gateway.fake_engine import MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

# (path, body, expected param or None); bodies are JSON unless bytes.
TOOLS = [{"type": "function", "function": {"name": "f"}}]
CASES = {
    "temperature above 2": (CHAT, {"messages": MSG, "temperature": 2.5}, "temperature"),
    "temperature negative": (COMPLETIONS, {"prompt": "x", "temperature": -0.1}, "temperature"),
    "top_p zero": (CHAT, {"messages": MSG, "top_p": 0}, "top_p"),
    "top_p above 1": (CHAT, {"messages": MSG, "top_p": 1.5}, "top_p"),
    "n zero": (CHAT, {"messages": MSG, "n": 0}, "n"),
    "n above cap": (COMPLETIONS, {"prompt": "x", "n": 17}, "n"),
    "max_tokens zero": (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens"),
    "max_completion_tokens negative": (CHAT, {"messages": MSG, "max_completion_tokens": -1},
                                       "max_completion_tokens"),
    "five stop strings": (CHAT, {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    "empty messages": (CHAT, {"messages": []}, "messages"),
    "missing messages": (CHAT, {"model": MODEL}, None),
    "bad role": (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    "image part": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content"),
    "empty prompt string": (COMPLETIONS, {"prompt": ""}, "prompt"),
    "fill-in-the-middle suffix": (COMPLETIONS, {"prompt": "def f(", "suffix": "):"}, "suffix"),
    "empty prompt list": (COMPLETIONS, {"prompt": []}, "prompt"),
    "empty token prompt": (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    "mixed prompt": (COMPLETIONS, {"prompt": ["a", 1]}, "prompt"),
    "out-of-vocab prompt id": (COMPLETIONS, {"prompt": [1, 99999]}, "prompt"),
    "negative prompt id": (COMPLETIONS, {"prompt": [[-1]]}, "prompt"),
    "out-of-vocab stop_token_ids": (CHAT, {"messages": MSG, "stop_token_ids": [99999]}, "stop_token_ids"),
    "min_tokens above max_tokens": (CHAT, {"messages": MSG, "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    "seed beyond int64": (CHAT, {"messages": MSG, "seed": 2**64}, "seed"),
    "seed below int64": (COMPLETIONS, {"prompt": "x", "seed": -2**63 - 1}, "seed"),
    "top_k below -1": (CHAT, {"messages": MSG, "top_k": -2}, "top_k"),
    "min_p above 1": (CHAT, {"messages": MSG, "min_p": 1.5}, "min_p"),
    "min_tokens negative": (COMPLETIONS, {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    "max_tokens beyond int32": (COMPLETIONS, {"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    "stop_token_ids beyond int32": (CHAT, {"messages": MSG, "stop_token_ids": [2**31]}, "stop_token_ids"),
    "non-object body": (CHAT, [1, 2], None),
    "string body": (CHAT, "hello", None),
    "invalid json": (CHAT, b'{"messages": [', None),
    "NaN": (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
    "Infinity": (COMPLETIONS, b'{"prompt": "x", "top_p": Infinity}', None),
    "lone surrogate": (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
    "invalid utf-8": (CHAT, b'{"messages": [{"role": "user", "content": "\xff"}]}', None),
    "wrong type": (CHAT, {"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
    "stream_options without stream": (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}},
                                      "stream_options"),
    "top_logprobs without logprobs": (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    "beam search past --max-logprobs": (COMPLETIONS, {"prompt": "x", "use_beam_search": True, "n": 11}, "n"),
    "best_of past n": (COMPLETIONS, {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    "too many bad_words": (CHAT, {"messages": MSG, "bad_words": ["no"] * 1025}, "bad_words"),
    "logits_processors": (COMPLETIONS, {"prompt": "x", "logits_processors": ["my.Proc"]}, "logits_processors"),
    "top_logprobs above 20": (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "negative top_logprobs": (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    "completion logprobs above 20": (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
    "presence_penalty above 2": (CHAT, {"messages": MSG, "presence_penalty": 2.5}, "presence_penalty"),
    "frequency_penalty below -2": (COMPLETIONS, {"prompt": "x", "frequency_penalty": -3},
                                   "frequency_penalty"),
    "repetition_penalty zero": (CHAT, {"messages": MSG, "repetition_penalty": 0}, "repetition_penalty"),
    "tools without the auto flags": (CHAT, {"messages": MSG, "tools": TOOLS}, "tool_choice"),
    "tool_choice without tools": (CHAT, {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    "unknown named tool": (CHAT, {"messages": MSG, "tools": TOOLS,
                                  "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    "forced tool and response_format": (CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": "required",
                                               "response_format": {"type": "json_object"}}, "tool_choice"),
    "json_schema without schema": (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}},
                                   "response_format"),
    "unsupported schema": (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "no-such-format"}}}}, "response_format"),
    "unknown response_format type": (CHAT, {"messages": MSG, "response_format": {"type": "xml"}},
                                     "response_format.type"),
    "bad regex": (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    "two kinds": (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
                  "structured_outputs"),
    "two constraints": (CHAT, {"messages": MSG, "guided_choice": ["a"], "response_format": {"type": "json_object"}},
                        "response_format"),
    "bad guided_grammar": (COMPLETIONS, {"prompt": "x", "guided_grammar": "root ::= ("}, "guided_grammar"),
    "empty guided_choice": (COMPLETIONS, {"prompt": "x", "guided_choice": [""]}, "guided_choice"),
    "ignore_eos with a constraint": (COMPLETIONS, {"prompt": "x", "guided_choice": ["a"], "ignore_eos": True},
                                     "ignore_eos"),
    "logit_bias outside the vocabulary": (COMPLETIONS, {"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),
    "logit_bias key not an id": (CHAT, {"messages": MSG, "logit_bias": {"a": 1}}, "logit_bias"),
}


@pytest.mark.parametrize("case", CASES)
async def test_bad_request(http, base_url, engine, case):
    path, body, param = CASES[case]
    if isinstance(body, bytes):
        reply = http.post(base_url + path, data=body, headers={"Content-Type": "application/json"})
    else:
        reply = http.post(base_url + path, json=body)
    async with reply as r:
        error = (await r.json())["error"]
        assert r.status == 400, error
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["code"] is None or isinstance(error["code"], str)
    if param is not None:
        assert error["param"] == param
    assert engine.requests == []


async def test_range_errors_say_what_sampling_params_says(http, base_url):
    async with http.post(base_url + CHAT, json={"messages": MSG, "top_p": 0}) as r:
        error = (await r.json())["error"]
    with pytest.raises(OutOfRange) as expected:
        SamplingParams(top_p=0.0)
    assert (error["message"], error["param"]) == (str(expected.value), "top_p")


async def test_unsupported_messages_say_what_to_do(http, base_url):
    async with http.post(base_url + CHAT, json={"messages": MSG, "response_format": {"type": "json_schema"}}) as r:
        assert "needs `json_schema.schema`" in (await r.json())["error"]["message"]
    async with http.post(base_url + CHAT, json={"messages": MSG, "tools": TOOLS, "tool_choice": "auto"}) as r:
        assert "--enable-auto-tool-choice and --tool-call-parser" in (await r.json())["error"]["message"]


async def test_best_of_equal_to_n_or_1_is_taken(http, base_url):
    for n, best_of in ((1, 1), (2, 2), (2, 1)):
        async with http.post(base_url + COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "n": n,
                                                           "best_of": best_of}) as r:
            assert r.status == 200, await r.text()
            assert len((await r.json())["choices"]) == n


async def test_null_means_default(http, base_url, engine):
    body = {"prompt": "x", "max_tokens": 2, "n": None, "stream": None, "echo": None}
    async with http.post(base_url + COMPLETIONS, json=body) as r:
        assert r.status == 200, await r.text()
        assert len((await r.json())["choices"]) == 1


async def test_accepted_extras(http, base_url):
    body = {"messages": MSG, "max_tokens": 2, "user": "u", "store": False, "metadata": {"a": 1},
            "parallel_tool_calls": False, "response_format": {"type": "text", "strict": True},
            "logprobs": False, "tool_choice": "none", "top_k": -1, "functions": [],
            # vLLM's options this server lacks, at their defaults.
            "use_beam_search": False, "bad_words": [], "logits_processors": None}
    async with http.post(base_url + CHAT, json=body) as r:
        assert r.status == 200, await r.text()


async def test_wrong_content_type(http, base_url):
    async with http.post(base_url + CHAT, data=b'{"messages": []}', headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 400
        assert "application/json" in (await r.json())["error"]["message"]


async def test_body_too_large(http, base_url):
    body = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    async with http.post(base_url + COMPLETIONS, data=body, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413
        error = (await r.json())["error"]
        assert set(error) == {"message", "type", "param", "code"} and "limit" in error["message"]


async def test_missing_chat_template(http, engine, tokenizer_dir, tmp_path):
    import json

    from pagedserve.gateway.app import build_app
    from pagedserve.gateway.server import start
    from pagedserve.common.tokenizer import Tokenizer

    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    runner = await start(build_app(Tokenizer.from_dir(tmp_path), engine.address), "127.0.0.1", 0)
    try:
        host, port = runner.addresses[0][:2]
        async with http.post(f"http://{host}:{port}{CHAT}", json={"messages": MSG}) as r:
            assert r.status == 400 and "no chat template" in (await r.json())["error"]["message"]
    finally:
        await runner.cleanup()
