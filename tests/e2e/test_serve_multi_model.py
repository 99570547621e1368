"""One `pagedserve serve` of SmolLM2 for chat `--also-serve` a tiny sentence-transformers embedder and
a tiny BERT cross-encoder: one base URL answers chat, /v1/embeddings and /v1/rerank, each model with
its own tokenizer and engine, and /v1/models lists all three (issue 27's bar)."""
import openai
import psutil
import pytest
import requests

from pagedserve import LLM
from pagedserve.entrypoints.launcher import http_ready
from tests.serving import free_port, pagedserve
from tests.tiny_encoders import make_rag_models

CHAT, EMBEDDER, RERANKER = "smollm2", "tiny-embedder", "tiny-reranker"
TEXTS = ["what is the capital of france", "paris", "the river in the city of berlin is a river of germany"]
QUERY = "the capital of germany"
# Float32 on both sides; the server batches the inputs differently than LLM does.
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return make_rag_models(tmp_path_factory.mktemp("rag"), EMBEDDER, RERANKER)


@pytest.fixture(scope="module")
def server(models):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["serve", "--served-model-name", CHAT, "--port", str(port), "--device", "cpu",
            "--num-gpu-blocks-override", "256", "--max-model-len", "1024", "--log-level", "warning",
            *(f"--also-serve={path},served-model-name={name}" for name, path in models.items())]
    with pagedserve(argv, http_ready(f"{url}/health")) as process:
        yield process, url


def test_one_base_url_answers_chat_embeddings_and_rerank(models, server):
    process, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [CHAT, EMBEDDER, RERANKER]
    reply = client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "What is the "
                                                                  "capital of France?"}], temperature=0)
    assert reply.model == CHAT and "Paris" in reply.choices[0].message.content
    embedder, reranker = LLM(str(models[EMBEDDER])), LLM(str(models[RERANKER]))
    expected = [o.outputs.embedding for o in embedder.embed(TEXTS, use_tqdm=False)]
    embeddings = client.embeddings.create(model=EMBEDDER, input=TEXTS)
    assert embeddings.model == EMBEDDER
    assert [d.embedding for d in embeddings.data] == [pytest.approx(e, abs=TOL) for e in expected]
    scores = [o.outputs.score for o in reranker.score(QUERY, TEXTS, use_tqdm=False)]
    ranked = requests.post(f"{url}/v1/rerank", json={"model": RERANKER, "query": QUERY, "documents": TEXTS},
                           timeout=60).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: -scores[i])
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
        [scores[r["index"]] for r in ranked["results"]], abs=TOL)
    assert len(psutil.Process(process.pid).children()) == 7, "the gateway, and an executor and scheduler per model"


def test_routes_refuse_a_model_of_the_other_runner_and_an_unknown_or_missing_model(server):
    _, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.chat.completions.create(model=EMBEDDER, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        client.embeddings.create(model=CHAT, input="hi")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="hi")
    reply = requests.post(f"{url}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"
