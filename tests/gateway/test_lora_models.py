"""LoRA adapters on the API: /v1/models lists each (its `parent` the model it runs on), a request
whose `model` names one runs on the model's schedulers with that adapter and reports the adapter's
name, and other names are still a 404."""
import asyncio

from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.fake_engine import serve_live_gateway


async def test_an_adapter_is_a_model_that_runs_on_its_base(http, engine, tokenizer):
    engine.lora_names = ["sql", "chat"]
    runner, url = await serve_live_gateway(tokenizer, engine.address)
    try:
        async with http.get(f"{url}/v1/models") as r:
            cards = {card["id"]: card.get("parent") for card in (await r.json())["data"]}
        async with http.get(f"{url}/v1/models/sql") as r:
            card = await r.json()
        body = {"model": "sql", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            answered = await r.json()
        async with http.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}) as r:
            assert r.status == 200
        async with http.post(f"{url}/v1/chat/completions", json={**body, "model": "nope"}) as r:
            missing = r.status, (await r.json())["error"]
    finally:
        await runner.cleanup()
    base = next(name for name, parent in cards.items() if parent is None)
    assert cards == {base: None, "sql": base, "chat": base} and card["parent"] == base
    assert answered["model"] == "sql"
    assert [r.lora_name for r in engine.requests] == ["sql", ""]
    assert missing[0] == 404 and missing[1]["param"] == "model"


async def test_metrics_name_the_running_and_waiting_adapters(http, engine, tokenizer):
    engine.lora_names = ["sql", "chat", "docs"]
    engine.lora_info = dict(max_loras=2, running_lora_adapters=["chat", "sql"], waiting_lora_adapters=["docs"])
    runner, url = await serve_live_gateway(tokenizer, engine.address)
    try:
        # The scheduler's series appear once the gateway's poll (every 0.5 s) has its ModelInfo.
        for _ in range(50):
            async with http.get(f"{url}/metrics") as r:
                text = await r.text()
            if "lora_requests_info" in text:
                break
            await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("pagedserve:lora_requests_info", "vllm:lora_requests_info"):
        [sample] = families[name].samples
        assert {k: sample.labels[k] for k in ("max_lora", "running_lora_adapters", "waiting_lora_adapters")} == \
            {"max_lora": "2", "running_lora_adapters": "chat,sql", "waiting_lora_adapters": "docs"}, name
