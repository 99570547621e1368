"""/v1/embeddings over the fake engine's Pool, with the openai SDK and LangChain: what it sends the
engine per input, how it returns the vectors, and what it refuses."""
import asyncio
import base64
import json
import struct

import openai
import pytest
import tiktoken
from langchain_openai import OpenAIEmbeddings
from langchain_openai.embeddings import base as langchain_embeddings

from tests.gateway.fake_engine import LEAK, MODEL, embedded

TEXTS = ["The quick brown fox", "Hello world! Hello there", "Grüße aus München 🎉"]
QUERY = "Which fox is quick?"


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)


async def test_openai_sdk_embeddings_base64_and_float_single_and_batched(embedder, serve, tokenizer):
    async with sdk(await serve()) as client:
        for given in (TEXTS[0], TEXTS):
            texts = [given] if isinstance(given, str) else given
            # The SDK asks for base64 unless told otherwise, and decodes it.
            for options in ({}, {"encoding_format": "float"}):
                reply = await client.embeddings.create(model=MODEL, input=given, **options)
                assert [d.index for d in reply.data] == list(range(len(texts)))
                for d, text in zip(reply.data, texts):
                    assert d.embedding == pytest.approx(embedded(tokenizer.encode(text)), abs=1e-6)
                tokens = sum(len(tokenizer.encode(t)) for t in texts)
                assert (reply.usage.prompt_tokens, reply.usage.total_tokens) == (tokens, tokens)
                assert reply.model == MODEL and reply.object == "list"


async def test_base64_is_little_endian_float32(embedder, serve, http, tokenizer):
    async with http.post(f"{await serve()}/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}) as r:
        data = base64.b64decode((await r.json())["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(data) // 4}f", data)) == pytest.approx(embedded(tokenizer.encode(TEXTS[0])),
                                                                            abs=1e-6)


async def test_token_id_input_and_its_options_reach_the_engine(embedder, serve):
    ids = [[5, 6, 7, 8, 9], [10, 11]]
    async with sdk(await serve()) as client:
        reply = await client.embeddings.create(model=MODEL, input=ids, encoding_format="float", dimensions=4,
                                               extra_body={"truncate_prompt_tokens": 3, "normalize": False})
    sent = embedder.pool_requests
    assert sorted(list(r.prompt_token_ids) for r in sent) == [[7, 8, 9], [10, 11]]
    assert {(r.params.task, r.params.dimensions, r.params.normalize) for r in sent} == {("embed", 4, False)}
    assert reply.data[0].embedding == pytest.approx(embedded([7, 8, 9], dimensions=4, normalize=False), abs=1e-5)
    assert reply.usage.prompt_tokens == 5


async def test_text_truncation_keeps_the_last_tokens_and_the_default_prompt_prefixes_text(embedder, serve,
                                                                                           tokenizer, http):
    embedder.pooling["default_prompt"] = "query: "
    url = await serve()
    async with http.post(f"{url}/v1/embeddings", json={"input": TEXTS[1], "truncate_prompt_tokens": 4}) as r:
        assert r.status == 200
    assert list(embedder.pool_requests[-1].prompt_token_ids) == tokenizer.encode_tail("query: " + TEXTS[1], 4)
    async with http.post(f"{url}/v1/embeddings", json={"input": [[5, 6]]}) as r:
        assert r.status == 200
    # Token ids are the model's input as they stand.
    assert list(embedder.pool_requests[-1].prompt_token_ids) == [5, 6]


async def _error(http, url: str, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, (await r.json())["error"]


HOSTILE_EMBEDDINGS = [
    ({"input": 5}, "input"), ({"input": {"a": 1}}, "input"), ({"input": None}, "input"), ({}, None),
    ({"input": [1, "a"]}, "input"), ({"input": [[1], "a"]}, "input"), ({"input": [[1, "a"]]}, "input"),
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": [2 ** 40]}, "input"), ({"input": [-1]}, "input"), ({"input": [[2 ** 70]]}, "input"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"), ({"input": "hi", "dimensions": 3}, "dimensions"),
    ({"input": "hi", "dimensions": -1}, "dimensions"), ({"input": "hi", "truncate_prompt_tokens": 0},
                                                        "truncate_prompt_tokens"),
    ({"input": "hi", "truncate_prompt_tokens": 10 ** 6}, "truncate_prompt_tokens"),
    ({"input": ["hi"] * 5000}, "input"), ({"input": "x " * 300}, "input"), ({"input": [[1] * 300]}, "input"),
    ({"input": "hi", "model": "other"}, "model"),
]


async def test_hostile_embedding_requests_get_openai_shaped_4xx(embedder, serve, http):
    url = await serve()
    for body, param in HOSTILE_EMBEDDINGS:
        status, error = await _error(http, url, "/v1/embeddings", body)
        assert 400 <= status < 500 and error["type"] == "invalid_request_error", body
        # The field, or for a wrong item its path (input[0][1]).
        assert (error["param"] or "").split("[")[0] == (param or ""), (body, error)
        assert not LEAK.search(error["message"]), error
    status, error = await _error(http, url, "/v1/embeddings", b"{not json")
    assert status == 400
    assert embedder.pool_requests == []


async def test_long_or_foreign_token_ids_name_langchains_setting(embedder, serve, http):
    url = await serve()
    for ids in ([[1] * 300], [[embedder.vocab_size]]):
        status, error = await _error(http, url, "/v1/embeddings", {"input": ids})
        assert status == 400 and "check_embedding_ctx_length=False" in error["message"]
    status, error = await _error(http, url, "/v1/embeddings", {"input": "x " * 300})
    assert error["code"] == "context_length_exceeded" and "truncate_prompt_tokens" in error["message"]
    assert "LangChain" not in error["message"]


async def test_langchain_openai_embeddings(embedder, serve, tokenizer, monkeypatch):
    url = await serve()
    # With check_embedding_ctx_length=False LangChain sends text: the model's own results.
    texting = OpenAIEmbeddings(model=MODEL, base_url=f"{url}/v1", api_key="EMPTY", max_retries=0,
                               check_embedding_ctx_length=False)
    documents = await asyncio.to_thread(texting.embed_documents, TEXTS)
    assert documents == [pytest.approx(embedded(tokenizer.encode(t)), abs=1e-6) for t in TEXTS]
    query = await asyncio.to_thread(texting.embed_query, QUERY)
    assert query == pytest.approx(embedded(tokenizer.encode(QUERY)), abs=1e-6)
    # Its defaults send tiktoken's ids: ones past this model's vocabulary get a 400 that says what to set.
    # (tiktoken downloads its files on first use, which tests cannot: a byte-level encoding whose ids
    # lie past the vocabulary stands in for cl100k_base, LangChain's fallback for unknown models.)
    encoding = tiktoken.Encoding("tiny", pat_str=r"\S+|\s+", special_tokens={},
                                 mergeable_ranks={bytes([b]): 1000 + b for b in range(256)})
    monkeypatch.setattr(langchain_embeddings.tiktoken, "encoding_for_model", lambda name: encoding)
    defaults = OpenAIEmbeddings(model=MODEL, base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)
    for call in (lambda: defaults.embed_documents(TEXTS), lambda: defaults.embed_query(QUERY)):
        with pytest.raises(openai.BadRequestError, match="check_embedding_ctx_length=False"):
            await asyncio.to_thread(call)
