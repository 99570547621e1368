"""`pagedserve serve --runner pooling` of a tiny sentence-transformers embedder and a tiny BERT
cross-encoder, started together, answering the RAG clients: the openai SDK, LangChain, Dify's calls,
the cohere SDK and the ollama client get what LLM.embed and LLM.score return for the same inputs."""
import asyncio

import cohere
import ollama
import openai
import pytest
import requests
import tiktoken
from langchain_openai import OpenAIEmbeddings
from langchain_openai.embeddings import base as langchain_embeddings

from pagedserve import LLM
from tests.serving import free_port, pagedserve_many
from tests.tiny_encoders import make_rag_models

EMBEDDER, RERANKER = "tiny-embedder", "tiny-reranker"
TEXTS = ["what is the capital of france", "paris", "the river in the city of berlin is a river of germany"]
QUERY = "the capital of germany"
# Float32 on both sides; the server batches the inputs differently than LLM does.
TOL = 1e-5


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=1).status_code == 200
    except requests.RequestException:
        return False


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return make_rag_models(tmp_path_factory.mktemp("rag"), EMBEDDER, RERANKER)


@pytest.fixture(scope="module")
def servers(models) -> dict:
    urls, services = {}, []
    for name, path in models.items():
        port = free_port()
        urls[name] = url = f"http://127.0.0.1:{port}"
        argv = ["serve", str(path), "--runner", "pooling", "--served-model-name", name, "--port", str(port),
                "--scheduler-address", f"127.0.0.1:{free_port()}"]
        services.append((argv, lambda url=url: _healthy(url)))
    with pagedserve_many(services):
        yield urls


@pytest.fixture(scope="module")
def offline(models) -> dict:
    return {name: LLM(str(path)) for name, path in models.items()}


def test_openai_sdk_embeddings_equal_llm_embed(servers, offline):
    client = openai.OpenAI(base_url=f"{servers[EMBEDDER]}/v1", api_key="EMPTY", max_retries=0)
    llm = offline[EMBEDDER]
    expected = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    for options in ({}, {"encoding_format": "float"}):
        batched = client.embeddings.create(model=EMBEDDER, input=TEXTS, **options)
        assert [d.embedding for d in batched.data] == [pytest.approx(e, abs=TOL) for e in expected]
        single = client.embeddings.create(model=EMBEDDER, input=TEXTS[1], **options)
        assert single.data[0].embedding == pytest.approx(expected[1], abs=TOL)
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    by_ids = client.embeddings.create(model=EMBEDDER, input=ids, encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [pytest.approx(e, abs=TOL) for e in expected]
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.embeddings.create(model=EMBEDDER, input=[[1, 10 ** 6]])


def test_langchain_embeddings(servers, offline, monkeypatch):
    expected = [o.outputs.embedding for o in offline[EMBEDDER].embed(TEXTS + [QUERY], use_tqdm=False)]
    texting = OpenAIEmbeddings(model=EMBEDDER, base_url=f"{servers[EMBEDDER]}/v1", api_key="EMPTY", max_retries=0,
                               check_embedding_ctx_length=False)
    assert texting.embed_documents(TEXTS) == [pytest.approx(e, abs=TOL) for e in expected[:-1]]
    assert texting.embed_query(QUERY) == pytest.approx(expected[-1], abs=TOL)
    # Defaults: tiktoken's ids (a stand-in encoding: tests cannot download cl100k_base) get a clear 400.
    encoding = tiktoken.Encoding("tiny", pat_str=r"\S+|\s+", special_tokens={},
                                 mergeable_ranks={bytes([b]): 1000 + b for b in range(256)})
    monkeypatch.setattr(langchain_embeddings.tiktoken, "encoding_for_model", lambda name: encoding)
    defaults = OpenAIEmbeddings(model=EMBEDDER, base_url=f"{servers[EMBEDDER]}/v1", api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="check_embedding_ctx_length=False"):
        defaults.embed_documents(TEXTS)


def test_ollama_embed_equals_openai_embeddings(servers):
    # The embedder ends in Normalize, so /v1/embeddings' vectors are normalised as Ollama's always are.
    reply = ollama.Client(host=servers[EMBEDDER]).embed(model=EMBEDDER, input=TEXTS)
    openai_reply = openai.OpenAI(base_url=f"{servers[EMBEDDER]}/v1", api_key="EMPTY", max_retries=0).embeddings.create(
        model=EMBEDDER, input=TEXTS, encoding_format="float")
    assert reply.embeddings == [pytest.approx(d.embedding, abs=TOL) for d in openai_reply.data]
    assert reply.prompt_eval_count == openai_reply.usage.prompt_tokens


def _dify(url: str, payload: dict) -> dict:
    # What Dify's OpenAI-API-compatible plugin posts, its empty Authorization header included.
    reply = requests.post(url, headers={"Content-Type": "application/json", "Authorization": ""}, json=payload,
                          timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_dify_embedding_and_rerank_calls(servers, offline):
    body = _dify(f"{servers[EMBEDDER]}/v1/embeddings", {"model": EMBEDDER, "input": TEXTS})
    expected = [o.outputs.embedding for o in offline[EMBEDDER].embed(TEXTS, use_tqdm=False)]
    assert [d["embedding"] for d in body["data"]] == [pytest.approx(e, abs=TOL) for e in expected]
    body = _dify(f"{servers[RERANKER]}/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": TEXTS,
                                                     "top_n": 3})
    scores = [o.outputs.score for o in offline[RERANKER].score(QUERY, TEXTS, use_tqdm=False)]
    assert [r["index"] for r in body["results"]] == sorted(range(3), key=lambda i: -scores[i])
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
        [scores[r["index"]] for r in body["results"]], abs=TOL)


def test_cohere_v2_rerank_and_score_equal_llm_score(servers, offline):
    llm = offline[RERANKER]
    scores = [o.outputs.score for o in llm.score(QUERY, TEXTS, use_tqdm=False)]
    reply = cohere.ClientV2(base_url=servers[RERANKER], api_key="EMPTY").rerank(
        model=RERANKER, query=QUERY, documents=TEXTS, top_n=2)
    assert [r.index for r in reply.results] == sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [r.relevance_score for r in reply.results] == pytest.approx([scores[r.index] for r in reply.results],
                                                                       abs=TOL)
    pairs = requests.post(f"{servers[RERANKER]}/score", json={"text_1": TEXTS, "text_2": TEXTS[::-1]}).json()
    expected = [o.outputs.score for o in llm.score(TEXTS, TEXTS[::-1], use_tqdm=False)]
    assert [d["score"] for d in pairs["data"]] == pytest.approx(expected, abs=TOL)
    # The bi-encoder scores by cosine, as LLM.score does.
    cosines = requests.post(f"{servers[EMBEDDER]}/v1/score", json={"text_1": QUERY, "text_2": TEXTS}).json()
    expected = [o.outputs.score for o in offline[EMBEDDER].score(QUERY, TEXTS, use_tqdm=False)]
    assert [d["score"] for d in cosines["data"]] == pytest.approx(expected, abs=TOL)


def test_classify_equals_llm_classify_and_names_the_label(servers, offline):
    """vLLM's /classify of the cross-encoder: its one label by the name config.json gives it."""
    reply = requests.post(f"{servers[RERANKER]}/classify", json={"model": RERANKER, "input": TEXTS}).json()
    expected = [o.outputs.probs for o in offline[RERANKER].classify(TEXTS, use_tqdm=False)]
    assert [d["probs"] for d in reply["data"]] == [pytest.approx(p, abs=TOL) for p in expected]
    assert {(d["label"], d["num_classes"]) for d in reply["data"]} == {("LABEL_0", 1)}


def test_each_model_refuses_what_it_cannot_serve(servers):
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        openai.OpenAI(base_url=f"{servers[EMBEDDER]}/v1", api_key="EMPTY", max_retries=0).chat.completions.create(
            model=EMBEDDER, messages=[{"role": "user", "content": "hi"}])
    reply = requests.post(f"{servers[RERANKER]}/v1/embeddings", json={"input": "hi"})
    assert reply.status_code == 400 and "classify" in reply.json()["error"]["message"]


def test_concurrent_requests_batch_on_the_engine(servers, offline):
    async def many() -> list:
        async with openai.AsyncOpenAI(base_url=f"{servers[EMBEDDER]}/v1", api_key="EMPTY", max_retries=0) as client:
            return await asyncio.gather(*(client.embeddings.create(model=EMBEDDER, input=t, encoding_format="float")
                                          for t in TEXTS * 4))
    replies = asyncio.run(many())
    expected = [o.outputs.embedding for o in offline[EMBEDDER].embed(TEXTS * 4, use_tqdm=False)]
    assert [r.data[0].embedding for r in replies] == [pytest.approx(e, abs=TOL) for e in expected]
