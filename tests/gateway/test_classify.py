"""vLLM's /classify on the fake engine as a three-label classifier: class probabilities, the most
probable class by its name, token-id inputs, raw logits on request, and the models it refuses."""
import math

import pytest

from pagedserve.v1 import engine_pb2 as pb
from tests.gateway.fake_engine import MODEL, fake_pooled
from tests.gateway.test_metrics import scrape, value

LABELS = ["negative", "neutral", "positive"]


@pytest.fixture
def classifier(engine):
    engine.runner = "pooling"
    engine.pooling = dict(pooling_tasks=["classify"], embedding_size=8, num_labels=3, labels=LABELS)
    return engine


def probs_of(ids: list[int], activation: bool | None = None) -> list[float]:
    params = pb.PoolingParams(task="classify", activation=activation)
    return fake_pooled(pb.PoolRequest(prompt_token_ids=ids, params=params), 8, 3)


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
async def test_probabilities_and_the_most_probable_label(classifier, base_url, http, tokenizer, path):
    texts = ["I love it", "meh", "this is awful"]
    async with http.post(f"{base_url}{path}", json={"model": MODEL, "input": texts}) as r:
        assert r.status == 200, await r.text()
        body = await r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-") and body["model"] == MODEL
    ids = [tokenizer.encode(t) for t in texts]
    for i, (data, prompt) in enumerate(zip(body["data"], ids)):
        want = probs_of(prompt)
        assert data["index"] == i and data["num_classes"] == 3 and data["probs"] == pytest.approx(want)
        assert math.isclose(sum(data["probs"]), 1, rel_tol=1e-6)
        assert data["label"] == LABELS[max(range(3), key=want.__getitem__)]
    tokens = sum(map(len, ids))
    assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
    assert value(await scrape(http, base_url), "pooling_requests_total", endpoint="classify") == 1


async def test_token_ids_raw_logits_and_unnamed_labels(classifier, serve, http):
    url = await serve()
    body = {"model": MODEL, "input": [[5, 6, 7]], "use_activation": False}
    async with http.post(f"{url}/classify", json=body) as r:
        data, = (await r.json())["data"]
    logits = probs_of([5, 6, 7], activation=False)
    assert data["probs"] == pytest.approx(logits) and data["label"] == LABELS[logits.index(max(logits))]
    classifier.pooling["labels"] = []
    unnamed = await serve()
    async with http.post(f"{unnamed}/classify", json={"model": MODEL, "input": [[5, 6, 7]]}) as r:
        assert (await r.json())["data"][0]["label"] == f"LABEL_{logits.index(max(logits))}"


async def test_an_embedder_and_a_generator_are_refused(engine, embedder, base_url, http):
    async with http.post(f"{base_url}/classify", json={"model": MODEL, "input": "x"}) as r:
        assert r.status == 400 and "/classify" in (await r.json())["error"]["message"]
    engine.runner = "generate"
    async with http.post(f"{base_url}/classify", json={"model": MODEL, "input": "x"}) as r:
        assert r.status == 400 and "pooling" in (await r.json())["error"]["message"]
    async with http.post(f"{base_url}/classify", json={"model": MODEL, "input": []}) as r:
        assert r.status == 400
