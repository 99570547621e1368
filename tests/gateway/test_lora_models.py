"""LoRA adapters on the API: /v1/models lists each (its `parent` the model it runs on), a request
whose `model` names one runs on the model's schedulers with that adapter and reports the adapter's
name, and other names are still a 404."""
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
