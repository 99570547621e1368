"""/metrics: Prometheus text whose counts and sums add up to exactly the traffic sent."""
import asyncio
import time

import grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.fake_engine import ENGINE_STATS, MODEL

P, G, N = 7, 5, 4  # prompt tokens, generated tokens, requests


async def scrape(http, base_url: str, **headers) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}."""
    async with http.get(f"{base_url}/metrics", headers=headers) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(f"pagedserve:{name}", tuple(sorted({"model_name": MODEL, **labels}.items())))]


async def _request(http, base_url: str, stream: bool) -> None:
    body = {"prompt": list(range(10, 10 + P)), "max_tokens": G, "stream": stream}
    async with http.post(f"{base_url}/v1/completions", json=body) as r:
        assert r.status == 200
        await r.read()


async def test_counts_and_sums_match_the_traffic(http, base_url):
    await asyncio.gather(*[_request(http, base_url, stream=i % 2 == 0) for i in range(N)])
    m = await scrape(http, base_url)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_params_n", "request_params_max_tokens"):
        assert value(m, f"{name}_count") == N, name
    assert value(m, "inter_token_latency_seconds_count") == N * (G - 1)
    assert value(m, "request_prompt_tokens_sum") == N * P
    assert value(m, "request_generation_tokens_sum") == N * G
    assert value(m, "request_params_max_tokens_sum") == N * G
    assert value(m, "prompt_tokens_total") == N * P
    assert value(m, "generation_tokens_total") == N * G
    assert value(m, "request_success_total", finished_reason="length") == N
    assert value(m, "request_success_total", finished_reason="stop") == 0
    assert value(m, "http_requests_client_disconnected_total") == 0
    assert value(m, "time_to_first_token_seconds_bucket", le="+Inf") == N
    assert value(m, "request_prompt_tokens_bucket", le="5.0") == 0
    assert value(m, "request_prompt_tokens_bucket", le="10.0") == N


async def test_n_choices_count_the_prompt_once(http, base_url):
    body = {"prompt": list(range(10, 10 + P)), "max_tokens": G, "n": 3}
    async with http.post(f"{base_url}/v1/completions", json=body) as r:
        assert r.status == 200
    m = await scrape(http, base_url)
    assert value(m, "prompt_tokens_total") == P and value(m, "generation_tokens_total") == 3 * G
    assert value(m, "request_success_total", finished_reason="length") == 3
    assert value(m, "request_params_n_sum") == 3 and value(m, "request_params_n_count") == 1


async def test_engine_series_come_from_the_scheduler(http, base_url):
    m = await scrape(http, base_url)
    assert value(m, "num_requests_running", engine="0") == ENGINE_STATS["num_running"]
    assert value(m, "num_requests_waiting", engine="0") == ENGINE_STATS["num_waiting"]
    assert value(m, "num_background_requests_running", engine="0") == ENGINE_STATS["num_background_running"]
    assert value(m, "num_background_requests_waiting", engine="0") == ENGINE_STATS["num_background_waiting"]
    assert value(m, "kv_cache_usage_perc", engine="0") == ENGINE_STATS["kv_cache_usage"]
    assert value(m, "num_preemptions_total", engine="0") == ENGINE_STATS["num_preemptions"]
    assert value(m, "prefix_cache_queries_total", engine="0") == ENGINE_STATS["prefix_cache_queries"]
    assert value(m, "prefix_cache_hits_total", engine="0") == ENGINE_STATS["prefix_cache_hits"]
    assert value(m, "cache_config_info", engine="0", block_size="16", num_gpu_blocks="100",
                 gpu_memory_utilization="0.9", enable_prefix_caching="True", cache_dtype="fp8") == 1
    assert not any(name.endswith("_created") for name, _ in m)


async def test_step_histograms_come_from_the_scheduler(http, base_url):
    m = await scrape(http, base_url)
    expected = {"step_schedule_seconds": ({"0.0001": 3, "0.001": 5, "+Inf": 5}, 0.0012),
                "step_forward_seconds": ({"0.001": 0, "0.01": 4, "+Inf": 5}, 0.05),
                "step_idle_seconds": ({"0.0001": 2, "0.001": 3, "+Inf": 4}, 0.0021)}
    for name, (buckets, total) in expected.items():
        assert {le: value(m, f"{name}_bucket", engine="0", le=le) for le in buckets} == buckets, name
        assert value(m, f"{name}_count", engine="0") == buckets["+Inf"], name
        assert value(m, f"{name}_sum", engine="0") == total, name


async def test_an_engine_without_step_histograms_leaves_them_out(http, base_url, engine):
    engine.steps = {}
    # A scrape shows the engine as last polled: wait for a poll that started after the change.
    calls = engine.info_calls
    while engine.info_calls < calls + 2:
        await asyncio.sleep(0.05)
    m = await scrape(http, base_url)
    assert value(m, "num_requests_running", engine="0") == ENGINE_STATS["num_running"]
    assert not any(name.startswith("pagedserve:step_") for name, _ in m)


async def test_scrapes_and_probes_call_no_scheduler(http, base_url, engine):
    """SEC-14: /metrics and /health need no key, so each must not be a call to every scheduler. The
    review's bar: 100 scrapes within 0.5 s make at most 2 GetModelInfo calls (the gateway's own poll,
    every 0.5 s); the bound allows the poll's calls for however long the requests took here."""
    from pagedserve.gateway.engine_pool import POLL_INTERVAL_S
    for path in ("/metrics", "/health"):
        async with http.get(base_url + path) as r:
            assert r.status == 200
        calls, started = engine.info_calls, time.monotonic()

        async def get() -> int:
            async with http.get(base_url + path) as r:
                await r.read()
                return r.status
        assert await asyncio.gather(*(get() for _ in range(100))) == [200] * 100
        polls = 2 + int((time.monotonic() - started) / POLL_INTERVAL_S)
        assert engine.info_calls - calls <= polls, path


async def test_rejections_by_reason(http, base_url, engine):
    bad = [{"prompt": "x", "temperature": 5}, {"prompt": "x", "max_tokens": 1000},
           {"model": "other", "prompt": "x"}]
    for body in bad:
        async with http.post(f"{base_url}/v1/completions", json=body) as r:
            assert r.status in (400, 404)
    async with http.post(f"{base_url}/v1/completions", data=b"x" * (5 * 1024 * 1024),
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413
    engine.reject = grpc.StatusCode.RESOURCE_EXHAUSTED
    async with http.post(f"{base_url}/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 503 and r.headers["Retry-After"]
        assert (await r.json())["error"]["code"] == "server_overloaded"
    m = await scrape(http, base_url)
    assert value(m, "request_rejected_total", reason="invalid") == 2
    assert value(m, "request_rejected_total", reason="too_long") == 2
    assert value(m, "request_rejected_total", reason="queue_full") == 1


async def test_disconnect_is_counted_once(http, base_url, engine):
    engine.delay = 0.05
    body = {"prompt": "x", "max_tokens": 100, "stream": True}
    async with http.post(f"{base_url}/v1/completions", json=body) as r:
        await r.content.readuntil(b"\n\n")
    await engine.wait_cancelled()
    m = await scrape(http, base_url)
    assert value(m, "http_requests_client_disconnected_total") == 1
    assert value(m, "request_success_total", finished_reason="length") == 0
    assert value(m, "e2e_request_latency_seconds_count") == 0
    assert value(m, "generation_tokens_total") >= 1


async def test_scrape_without_scheduler_still_answers(http, dead_engine_url):
    async with http.get(f"{dead_engine_url}/metrics") as r:
        assert r.status == 200
        assert "num_requests_running" not in await r.text()


async def test_openmetrics_on_request(http, base_url):
    async with http.get(f"{base_url}/metrics", headers={"Accept": "application/openmetrics-text"}) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        assert (await r.text()).endswith("# EOF\n")


async def test_vllm_series_equal_their_pagedserve_twins(http, base_url):
    await asyncio.gather(*[_request(http, base_url, stream=i % 2 == 0) for i in range(N)])
    async with http.get(f"{base_url}/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(await r.text())}
    vllm = {name: f for name, f in families.items() if name.startswith("vllm:")}
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "gpu_cache_usage_perc",
                 "prefix_cache_queries", "prefix_cache_hits", "cache_config_info", "time_to_first_token_seconds",
                 "e2e_request_latency_seconds", "inter_token_latency_seconds", "request_success", "prompt_tokens",
                 "generation_tokens", "request_prompt_tokens", "request_generation_tokens"):
        assert f"vllm:{name}" in vllm, name
    assert vllm["vllm:prefix_cache_hits"].type == "counter" and vllm["vllm:kv_cache_usage_perc"].type == "gauge"
    assert vllm["vllm:request_success"].samples[0].name == "vllm:request_success_total"
    for name, family in vllm.items():
        short = name.removeprefix("vllm:")
        twin = families["pagedserve:" + ("kv_cache_usage_perc" if short == "gpu_cache_usage_perc" else short)]
        assert family.type == twin.type and _samples(family) == _samples(twin), name
        assert all(s.labels["model_name"] == MODEL for s in family.samples), name
    assert ("_count", {"model_name": MODEL}, N) in _samples(vllm["vllm:time_to_first_token_seconds"])


def _samples(family) -> list[tuple[str, dict, float]]:
    """Name suffix (_total, _bucket, ...), labels and value of each sample."""
    return [(s.name[len(family.name):], s.labels, s.value) for s in family.samples]
