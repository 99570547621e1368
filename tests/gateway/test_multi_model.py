"""One gateway in front of two models (--also-serve): requests go to the engine serving the `model`
they name, each model with its own tokenizer, names and metrics; an unknown model is a 404, a missing
one a 400, and a model whose schedulers are down does not hold up the other."""
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.common.tokenizer import Tokenizer
from pagedserve.gateway.engine_pool import EnginePool
from pagedserve.gateway.server import also_serve_spec, also_served
from pagedserve.gateway.state import ModelEngines
from tests.gateway.fake_engine import LEAK, MODEL, FakeEngine, add_fake_engine, build_tiny_tokenizer, serve_gateway

OTHER = "other-model"
TEXT = "Hello world! The quick brown fox."


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Tokenizer:
    # Fewer merges than the main model's: the same text gets other ids.
    path = tmp_path_factory.mktemp("other_tokenizer")
    build_tiny_tokenizer(path, vocab_size=280)
    return Tokenizer.from_dir(path)


async def start_engine(fake: FakeEngine) -> grpc.aio.Server:
    server = grpc.aio.server()
    await add_fake_engine(server, fake)
    fake.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server


@pytest.fixture
async def engines(tokenizer, other_tokenizer):
    main, other = FakeEngine(tokenizer), FakeEngine(other_tokenizer)
    other.model, other.max_model_len = OTHER, 128
    servers = [await start_engine(main), await start_engine(other)]
    yield main, other
    for server in servers:
        await server.stop(0)


@pytest.fixture
async def gateway(engines, tokenizer, other_tokenizer):
    """Serves the two models; returns the base URL and a function starting a gateway with other options."""
    main, other = engines
    runners = []

    async def start(address: str = other.address, names: list[str] | None = None) -> str:
        also = ModelEngines(EnginePool(address), other_tokenizer, names or [])
        runner, url = await serve_gateway(tokenizer, main.address, also_serve=[also])
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


async def post(http, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


async def test_v1_models_lists_both_with_their_context_length(http, gateway):
    url = await gateway()
    async with http.get(f"{url}/v1/models") as r:
        cards = (await r.json())["data"]
    assert [(c["id"], c["max_model_len"], c["object"]) for c in cards] == [
        (MODEL, 256, "model"), (OTHER, 128, "model")]
    async with http.get(f"{url}/v1/models/{OTHER}") as r:
        assert (await r.json())["id"] == OTHER


async def test_each_request_goes_to_the_engine_serving_its_model(http, gateway, engines, tokenizer,
                                                                 other_tokenizer):
    url, (main, other) = await gateway(), engines
    for model, fake, own in ((OTHER, other, other_tokenizer), (MODEL, main, tokenizer),
                             (OTHER, other, other_tokenizer)):
        status, reply = await post(http, f"{url}/v1/completions", {"model": model, "prompt": TEXT, "max_tokens": 2})
        assert status == 200 and reply["model"] == model
        # Tokenized with its model's tokenizer, and the reply detokenized with it.
        assert list(fake.requests[-1].prompt_token_ids) == own.encode(TEXT)
        assert reply["choices"][0]["text"] == own.decode(fake.reply[:2])
    assert (len(main.requests), len(other.requests)) == (1, 2)
    status, reply = await post(http, f"{url}/v1/chat/completions",
                               {"model": OTHER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200 and reply["model"] == OTHER and len(other.requests) == 3


async def test_each_model_tokenizes_with_its_own_tokenizer(http, gateway, tokenizer, other_tokenizer):
    url = await gateway()
    counts = {}
    for model, own in ((MODEL, tokenizer), (OTHER, other_tokenizer)):
        status, reply = await post(http, f"{url}/tokenize", {"model": model, "prompt": TEXT})
        assert status == 200 and reply["tokens"] == own.encode(TEXT)
        counts[model] = reply["count"]
        status, back = await post(http, f"{url}/detokenize", {"model": model, "tokens": reply["tokens"]})
        assert status == 200 and back["prompt"].endswith(TEXT)
    assert counts[MODEL] != counts[OTHER]


async def test_aliases_reach_the_model_and_responses_name_its_first_name(http, gateway, engines):
    url = await gateway(names=["embedder", "text-embedding-3-small"])
    status, reply = await post(http, f"{url}/v1/completions",
                               {"model": "text-embedding-3-small", "prompt": TEXT, "max_tokens": 1})
    assert status == 200 and reply["model"] == "embedder" and len(engines[1].requests) == 1
    async with http.get(f"{url}/v1/models") as r:
        assert [c["id"] for c in (await r.json())["data"]] == [MODEL, "embedder"]
    status, _ = await post(http, f"{url}/v1/completions", {"model": OTHER, "prompt": TEXT, "max_tokens": 1})
    assert status == 404


async def test_an_unknown_model_is_a_404_in_openais_shape(http, gateway):
    url = await gateway()
    status, reply = await post(http, f"{url}/v1/completions", {"model": "gpt-4", "prompt": TEXT})
    assert status == 404
    assert reply == {"error": {"message": "The model `gpt-4` does not exist.", "type": "invalid_request_error",
                               "param": "model", "code": "model_not_found"}}
    async with http.get(f"{url}/v1/models/gpt-4") as r:
        assert r.status == 404


async def test_a_request_without_model_is_a_400_naming_the_field(http, gateway, engines):
    url = await gateway()
    for path, body in (("/v1/completions", {"prompt": TEXT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/tokenize", {"prompt": TEXT})):
        status, reply = await post(http, url + path, body)
        assert status == 400 and reply["error"]["param"] == "model", path
        assert "several models" in reply["error"]["message"]
    assert not engines[0].requests and not engines[1].requests


async def test_metrics_label_each_models_series(http, gateway):
    url = await gateway()
    for model in (MODEL, OTHER):
        await post(http, f"{url}/v1/completions", {"model": model, "prompt": TEXT, "max_tokens": 2})
    status, _ = await post(http, f"{url}/v1/chat/completions", {"model": OTHER, "top_logprobs": 2,
                                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400
    async with http.get(f"{url}/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(await r.text())}
    success = families["vllm:request_success"].samples
    assert {s.labels["model_name"] for s in success if s.value} == {MODEL, OTHER}
    running = families["vllm:num_requests_running"].samples
    assert sorted((s.labels["model_name"], s.labels["engine"]) for s in running) == [(OTHER, "0"), (MODEL, "0")]
    rejected = [s for s in families["pagedserve:request_rejected"].samples if s.value]
    assert [(s.labels["model_name"], s.labels["reason"]) for s in rejected] == [(OTHER, "invalid")]
    # Each model's token histograms end at its own context length.
    buckets = {(s.labels["model_name"], s.labels["le"]) for s in families["vllm:request_prompt_tokens"].samples
               if s.name.endswith("_bucket")}
    assert (MODEL, "200.0") in buckets and (OTHER, "200.0") not in buckets and (OTHER, "100.0") in buckets


async def test_a_model_whose_schedulers_are_down_does_not_hold_up_the_other(http, gateway, unused_tcp_port):
    url = await gateway(address=f"127.0.0.1:{unused_tcp_port}")
    status, reply = await post(http, f"{url}/v1/completions", {"model": MODEL, "prompt": TEXT, "max_tokens": 1})
    assert status == 200 and reply["model"] == MODEL
    async with http.get(f"{url}/v1/models") as r:
        assert [c["id"] for c in (await r.json())["data"]] == [MODEL]
    status, reply = await post(http, f"{url}/v1/completions", {"model": OTHER, "prompt": TEXT, "max_tokens": 1})
    assert status == 503
    async with http.get(f"{url}/health") as r:
        assert r.status == 200


async def test_two_models_may_not_share_a_name(tokenizer, other_tokenizer, engines):
    also = ModelEngines(EnginePool(engines[1].address), other_tokenizer, ["shared", "b"])
    with pytest.raises(ValueError, match="'shared' is given twice"):
        await serve_gateway(tokenizer, engines[0].address, served_model_names=["shared"], also_serve=[also])
    await also.engines.close()


async def test_health_names_each_models_engines_when_none_serves(http, tokenizer, other_tokenizer,
                                                                  unused_tcp_port_factory):
    dead = [f"127.0.0.1:{unused_tcp_port_factory()}" for _ in range(3)]
    also = ModelEngines(EnginePool(dead[2]), other_tokenizer)
    runner, url = await serve_gateway(tokenizer, f"{dead[0]},{dead[1]}", also_serve=[also])
    try:
        async with http.get(f"{url}/health") as r:
            status, message = r.status, (await r.json())["error"]["message"]
    finally:
        await runner.cleanup()
    assert status == 503
    assert message.startswith("No scheduler is serving. Model 0 engine 0: ")
    assert "Model 0 engine 1: " in message and "Model 1 engine 0: " in message and not LEAK.search(message)


async def test_a_gateways_also_serve_loads_the_models_tokenizer_names_and_chat_template(tokenizer_dir, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    model = also_served(also_serve_spec(f"{tokenizer_dir},scheduler-address=127.0.0.1:1,served-model-name=x,y,"
                                        f"chat-template={template}"))
    try:
        assert model.served_model_names == ["x", "y"]
        variables = model.tokenizer.chat_variables([{"role": "user", "content": "hi"}], False, None, None)
        assert model.tokenizer.render_chat(variables) == "[hi]"
    finally:
        await model.engines.close()
