"""One gateway in front of two fake schedulers (--scheduler-address A,B): requests spread, shared
prefixes stay together, a scheduler that goes down leaves the rotation and comes back, /health and
/metrics cover both."""
import asyncio
import json
import time

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.gateway import engine_pool
from pagedserve.gateway.engine_pool import POLL_INTERVAL_S
from pagedserve.gateway.state import GATEWAY
from tests.gateway.fake_engine import LEAK, FakeEngine, add_fake_engine, serve_gateway

COMPLETIONS = "/v1/completions"


class FakeScheduler:
    """A FakeEngine on its own gRPC server, which can stop and start again on the same port."""

    def __init__(self, tokenizer) -> None:
        self.fake = FakeEngine(tokenizer)
        self.port = 0
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server()
        await add_fake_engine(self.server, self.fake)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
async def schedulers(tokenizer):
    pair = [FakeScheduler(tokenizer), FakeScheduler(tokenizer)]
    for s in pair:
        await s.start()
    yield pair
    for s in pair:
        await s.server.stop(0)


@pytest.fixture
async def gateway(schedulers, tokenizer):
    runner, url = await serve_gateway(tokenizer, ",".join(s.address for s in schedulers))
    yield url, runner.app[GATEWAY].models[0].engines
    await runner.cleanup()


async def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def complete(http, url: str, prompt, **extra) -> int:
    async with http.post(url + COMPLETIONS, json={"prompt": prompt, "max_tokens": 3, **extra}) as r:
        await r.read()
        return r.status


async def test_a_burst_spreads_over_both_and_n_choices_stay_together(http, gateway, schedulers):
    url, pool = gateway
    await wait_until(lambda: all(e.down is None for e in pool.engines))
    statuses = await asyncio.gather(*[complete(http, url, "x") for _ in range(16)],
                                    complete(http, url, "x", n=3))
    assert statuses == [200] * 17
    counts = [len(s.fake.requests) for s in schedulers]
    assert sum(counts) == 19 and min(counts) >= 4
    ids = [[r.request_id for r in s.fake.requests] for s in schedulers]
    # The n=3 request's engine requests end in -0, -1, -2 and share their request's id.
    triples = [{i.rsplit("-", 1)[0] for i in mine if i.endswith("-2")} for mine in ids]
    rid = next(iter(triples[0] | triples[1]))
    assert sum(f"{rid}-{k}" in mine for mine in ids for k in range(3)) == 3
    assert any(all(f"{rid}-{k}" in mine for k in range(3)) for mine in ids)


async def test_prompts_sharing_a_prefix_meet_on_one_scheduler(http, gateway, schedulers):
    url, pool = gateway
    await wait_until(lambda: all(e.down is None for e in pool.engines))
    shared = [10 + i % 200 for i in range(80)]
    for tail in range(6):
        assert await complete(http, url, shared + [tail, tail + 1]) == 200
    counts = sorted(len(s.fake.requests) for s in schedulers)
    assert counts == [0, 6]


async def test_a_scheduler_that_goes_down_leaves_the_rotation_and_comes_back(http, gateway, schedulers):
    url, pool = gateway
    await wait_until(lambda: all(e.down is None for e in pool.engines))
    await schedulers[1].stop()
    await wait_until(lambda: pool.engines[1].down is not None)
    before = len(schedulers[1].fake.requests)
    assert await asyncio.gather(*[complete(http, url, "x") for _ in range(8)]) == [200] * 8
    async with http.get(f"{url}/health") as r:
        assert r.status == 200
    assert len(schedulers[1].fake.requests) == before
    await schedulers[1].start()
    await wait_until(lambda: pool.engines[1].down is None)
    assert await asyncio.gather(*[complete(http, url, "x") for _ in range(8)]) == [200] * 8
    assert len(schedulers[1].fake.requests) > before


async def test_only_the_failed_schedulers_in_flight_requests_fail(http, schedulers, tokenizer, monkeypatch):
    """With polls far apart, it is the failed calls that take the scheduler out of rotation."""
    monkeypatch.setattr(engine_pool, "POLL_INTERVAL_S", 60.0)
    runner, url = await serve_gateway(tokenizer, ",".join(s.address for s in schedulers))
    pool = runner.app[GATEWAY].models[0].engines
    try:
        await wait_until(lambda: all(e.down is None for e in pool.engines))
        for s in schedulers:
            s.fake.delay = 0.05

        async def stream() -> list[str]:
            body = {"prompt": "x", "max_tokens": 40, "stream": True}
            async with http.post(url + COMPLETIONS, json=body) as r:
                return [line[6:].strip().decode() async for line in r.content if line.startswith(b"data: ")]

        streams = [asyncio.create_task(stream()) for _ in range(6)]
        await wait_until(lambda: sum(len(s.fake.requests) for s in schedulers) == 6)
        on_failed = len(schedulers[1].fake.requests)
        await asyncio.sleep(0.2)
        await schedulers[1].stop()
        results = await asyncio.gather(*streams)
        failed = [r for r in results if "error" in json.loads(r[-2])]
        assert 0 < on_failed < 6 and len(failed) == on_failed
        assert all(r[-1] == "[DONE]" for r in results)
        for s in schedulers:
            s.fake.delay = 0.001
        assert await asyncio.gather(*[complete(http, url, "x") for _ in range(8)]) == [200] * 8
    finally:
        await runner.cleanup()


async def test_health_is_503_naming_the_engines_only_when_none_serves(http, gateway, schedulers):
    url, _ = gateway
    await schedulers[0].stop()
    async with http.get(f"{url}/health") as r:
        assert r.status == 200
    await schedulers[1].stop()
    # /health answers from states at most HEALTH_MAX_AGE_S old.
    status, deadline = 200, time.monotonic() + 5
    while status == 200 and time.monotonic() < deadline:
        async with http.get(f"{url}/health") as r:
            status, message = r.status, (await r.json()).get("error", {}).get("message")
    assert status == 503 and "Engine 0" in message and "Engine 1" in message and not LEAK.search(message)
    assert await complete(http, url, "x") == 503


async def test_a_scheduler_serving_another_model_stays_out_of_rotation(http, schedulers, tokenizer):
    schedulers[1].fake.model = "another-model"
    runner, url = await serve_gateway(tokenizer, ",".join(s.address for s in schedulers))
    pool = runner.app[GATEWAY].models[0].engines
    try:
        await wait_until(lambda: pool.engines[0].down is None)
        await asyncio.sleep(2 * POLL_INTERVAL_S)
        assert "another model" in pool.engines[1].down
        assert await asyncio.gather(*[complete(http, url, "x") for _ in range(6)]) == [200] * 6
        assert not schedulers[1].fake.requests
    finally:
        await runner.cleanup()


async def test_metrics_label_each_engine(http, gateway):
    url, pool = gateway
    async with http.get(f"{url}/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(await r.text())}
    for name in ("pagedserve:num_requests_running", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits"):
        assert sorted(s.labels["engine"] for s in families[name].samples) == ["0", "1"], name
