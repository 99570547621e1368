"""Every response body, stream chunks included, validated against OpenAI's own OpenAPI schemas."""
import copy
import json

import aiohttp
import pytest
from jsonschema import Draft202012Validator

from tests.gateway.fake_engine import MODEL

CHAT = [{"role": "user", "content": "Say hello"}]


def nullable_to_any_of(node):
    """OpenAPI 3.0's `nullable: true`, which a 3.1 (JSON Schema) validator ignores, as anyOf with null."""
    if isinstance(node, list):
        return [nullable_to_any_of(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: nullable_to_any_of(v) for k, v in node.items()}
    if node.get("nullable") is True:
        del node["nullable"]
        return {"anyOf": [node, {"type": "null"}]}
    return node


@pytest.fixture(scope="module")
def validate(openai_spec):
    components = copy.deepcopy(openai_spec["components"])
    # The spec shares this schema between completion responses and stream chunks but types finish_reason
    # and usage as non-null, yet OpenAI's streams (and vLLM's) send null in both on every chunk but the
    # last, as the chat chunk schema allows.
    completion = components["schemas"]["CreateCompletionResponse"]["properties"]
    completion["choices"]["items"]["properties"]["finish_reason"]["nullable"] = True
    completion["usage"]["nullable"] = True
    components = nullable_to_any_of(components)

    def check(name: str, body: dict) -> None:
        schema = {"$ref": f"#/components/schemas/{name}", "components": components}
        validator = Draft202012Validator(schema)
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]
        assert not errors, f"{name}: {errors} in {json.dumps(body)[:500]}"

    return check


def _events(raw: str) -> list[dict]:
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


async def _post(http, url: str, body: dict) -> tuple[int, str]:
    async with http.post(url, json=body) as r:
        return r.status, await r.text()


def test_the_patch_makes_nullable_fields_accept_null():
    patched = nullable_to_any_of({"properties": {"a": {"type": "string", "nullable": True},
                                                 "nullable": {"type": "string"}}})
    validator = Draft202012Validator(patched)
    assert validator.is_valid({"a": None}) and not validator.is_valid({"a": 1})
    assert patched["properties"]["nullable"] == {"type": "string"}


async def test_chat(http, base_url, validate):
    for extra in ({}, {"n": 2, "stop": ["fox"]}, {"max_tokens": 3}, {"logprobs": True, "top_logprobs": 2}):
        status, body = await _post(http, f"{base_url}/v1/chat/completions",
                                   {"model": MODEL, "messages": CHAT, "max_tokens": 30, **extra})
        assert status == 200
        validate("CreateChatCompletionResponse", json.loads(body))


async def test_chat_stream_chunks(http, base_url, validate):
    for extra in ({}, {"stream_options": {"include_usage": True}, "n": 2}, {"stop": "quick"},
                  {"logprobs": True, "top_logprobs": 3}):
        status, raw = await _post(http, f"{base_url}/v1/chat/completions",
                                  {"messages": CHAT, "max_tokens": 30, "stream": True, **extra})
        assert status == 200
        chunks = _events(raw)
        assert len(chunks) > 3
        for chunk in chunks:
            validate("CreateChatCompletionStreamResponse", chunk)


async def test_completions_and_their_stream(http, base_url, validate):
    for extra in ({}, {"prompt": ["a", "b"], "n": 2, "echo": True}, {"logprobs": 3}):
        status, body = await _post(http, f"{base_url}/v1/completions",
                                   {"prompt": "Once", "max_tokens": 10, **extra})
        assert status == 200
        validate("CreateCompletionResponse", json.loads(body))
    for extra in ({}, {"logprobs": 2}):
        status, raw = await _post(http, f"{base_url}/v1/completions",
                                  {"prompt": "Once", "max_tokens": 10, "stream": True,
                                   "stream_options": {"include_usage": True}, **extra})
        for chunk in _events(raw):
            validate("CreateCompletionResponse", chunk)


async def test_models(http, base_url, validate):
    async with http.get(f"{base_url}/v1/models") as r:
        validate("ListModelsResponse", await r.json())
    async with http.get(f"{base_url}/v1/models/{MODEL}") as r:
        validate("Model", await r.json())


async def test_errors(http, base_url, engine, validate):
    for path, body in (("/v1/chat/completions", {"messages": []}), ("/v1/completions", {"model": "x"}),
                       ("/v1/completions", {"prompt": [1] * 300, "max_tokens": 10})):
        async with http.post(base_url + path, json=body) as r:
            assert r.status in (400, 404)
            validate("ErrorResponse", await r.json())
    engine.fail_after = 2
    status, raw = await _post(http, f"{base_url}/v1/completions", {"prompt": "x", "stream": True})
    validate("ErrorResponse", _events(raw)[-1])


async def test_embeddings(http, embedder, serve, validate):
    url = await serve()
    for given in ("Say hello", ["Say hello", "Hello"], [[5, 6, 7]]):
        status, text = await _post(http, f"{url}/v1/embeddings", {"input": given, "encoding_format": "float"})
        assert status == 200
        validate("CreateEmbeddingResponse", json.loads(text))


def _without_nulls(body):
    # The spec types a batch's unset times and file ids, and a file's expires_at, as non-null where
    # OpenAI sends null (its SDK types them optional): checked as absent.
    if isinstance(body, list):
        return [_without_nulls(v) for v in body]
    if isinstance(body, dict):
        return {k: _without_nulls(v) for k, v in body.items() if v is not None}
    return body


async def test_files_and_batches(http, serve, tmp_path, validate):
    url = await serve(batch_dir=tmp_path)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once", "max_tokens": 2}}
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", json.dumps(line).encode(), filename="in.jsonl")
    async with http.post(f"{url}/v1/files", data=form) as r:
        file = await r.json()
    validate("OpenAIFile", _without_nulls(file))
    async with http.get(f"{url}/v1/files") as r:
        validate("ListFilesResponse", _without_nulls(await r.json()))
    async with http.post(f"{url}/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/completions",
                                                    "completion_window": "24h"}) as r:
        batch = await r.json()
    validate("Batch", _without_nulls(batch))
    async with http.get(f"{url}/v1/batches") as r:
        validate("ListBatchesResponse", _without_nulls(await r.json()))
    async with http.delete(f"{url}/v1/files/{file['id']}") as r:
        validate("DeleteFileResponse", await r.json())
