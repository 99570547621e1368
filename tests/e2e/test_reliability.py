"""The whole stack on the default model, as real processes: a mixed soak, SIGTERM with 30 active
streams, overload against a bounded queue, and a split deployment whose executor and scheduler are
killed and restarted. Loopback only; counts and durations bounded (PAGEDSERVE_SOAK_S sets the soak's)."""
import asyncio
import json
import os
import re
import signal
import subprocess
import time
from contextlib import ExitStack

import aiohttp
import psutil
import pytest

from pagedserve.entrypoints.launcher import grpc_ready, http_ready
from pagedserve.gateway.server import raise_open_files_limit
from tests.serving import free_port, pagedserve, wait_health

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SHUTDOWN_TIMEOUT_S = 2.0
SOAK_S = float(os.environ.get("PAGEDSERVE_SOAK_S", "20"))


def long_chat(max_tokens: int, stream: bool = True) -> dict:
    return {"messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def serve(port: int, *flags: str):
    return pagedserve(["serve", "--port", str(port), "--num-gpu-blocks-override", "1024", "--max-model-len", "1024",
                       "--log-level", "warning", *flags], http_ready(f"http://127.0.0.1:{port}/health"))


async def read_stream(http: aiohttp.ClientSession, url: str, body: dict, started: list | None = None) -> dict:
    """One streamed request: its status and headers, and its events ([DONE] included) or error body."""
    async with http.post(url, json=body) as r:
        result = {"status": r.status, "retry_after": r.headers.get("Retry-After"), "events": []}
        if r.status != 200:
            result["error"] = (await r.json())["error"]
            return result
        async for line in r.content:
            if line.startswith(b"data: "):
                if not result["events"] and started is not None:
                    started.append(1)
                result["events"].append(line[6:].strip().decode())
        return result


def ended_well(events: list[str]) -> bool:
    """The stream ended with [DONE] after an error event in OpenAI's shape or a finish_reason."""
    if len(events) < 2 or events[-1] != "[DONE]":
        return False
    last = json.loads(events[-2])
    if "error" in last:
        return set(last["error"]) == {"message", "type", "param", "code"}
    return last["choices"][0]["finish_reason"] in ("stop", "length")


SAMPLE = re.compile(r"^(pagedserve:\w+)(\{[^}]*\})? (\S+)$", re.M)


async def scrape(http: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """/metrics as {name{labels}: value}."""
    async with http.get(f"{base}/metrics") as r:
        return {name + labels: float(value) for name, labels, value in SAMPLE.findall(await r.text())}


def gauge(metrics: dict[str, float], name: str) -> float:
    return next(v for k, v in metrics.items() if k.startswith(f"pagedserve:{name}{{"))


async def wait_idle(http: aiohttp.ClientSession, base: str, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = await scrape(http, base)
        if gauge(metrics, "num_requests_running") == gauge(metrics, "num_requests_waiting") == 0:
            return metrics
        assert time.monotonic() < deadline, "requests still running or waiting"
        await asyncio.sleep(0.2)


def family_rss(process: subprocess.Popen) -> dict[int, int]:
    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    return {p.pid: p.memory_info().rss for p in tree}


@pytest.fixture(scope="module")
def server():
    port = free_port()
    with serve(port, "--max-num-seqs", "32", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)) as process:
        yield process, f"http://127.0.0.1:{port}"


async def soak_client(http: aiohttp.ClientSession, base: str, i: int, deadline: float, errors: list) -> int:
    """Requests until the deadline; a quarter of the clients leave each stream after its first event."""
    done = 0
    while time.monotonic() < deadline:
        kind = "leave" if i % 4 == 0 else ("stream", "whole", "invalid")[done % 3]
        try:
            if kind == "leave":
                async with http.post(base + CHAT, json=long_chat(64)) as r:
                    await r.content.readuntil(b"\n\n")
            elif kind == "invalid":
                async with http.post(base + CHAT, json={"messages": [], "max_tokens": 4}) as r:
                    if r.status != 400:
                        errors.append(f"invalid request got {r.status}")
            elif kind == "stream":
                result = await read_stream(http, base + COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": 8,
                                                                      "stream": True})
                if result["status"] != 200 or not ended_well(result["events"]):
                    errors.append(f"stream: {result}")
            else:
                async with http.post(base + COMPLETIONS, json={"prompt": "The sea is", "max_tokens": 8}) as r:
                    if r.status != 200:
                        errors.append(f"request got {r.status}: {await r.text()}")
        except aiohttp.ClientError as e:
            errors.append(f"{kind}: {e!r}")
        done += 1
    return done


async def test_mixed_soak_has_no_errors_and_flat_memory(server):
    """16 clients for SOAK_S seconds (the bar: 120): no errors, gauges back at 0, and no process's RSS
    grows by more than 10% from the first minute (a third of a shorter soak) to the end."""
    process, base = server
    errors: list[str] = []
    warm_s = 60.0 if SOAK_S >= 120 else SOAK_S / 3
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + SOAK_S
        clients = asyncio.gather(*[soak_client(http, base, i, deadline, errors) for i in range(16)])
        await asyncio.sleep(warm_s)
        warm = family_rss(process)
        counts = await clients
        await wait_idle(http, base)
    end = family_rss(process)
    assert not errors, errors[:5]
    assert sum(counts) > 16
    grown = {pid: round(end[pid] / rss - 1, 3) for pid, rss in warm.items() if end[pid] > 1.1 * rss}
    assert not grown, f"RSS grew by more than 10%: {grown}"


async def test_sigterm_lets_streams_end_with_an_error_and_done(server):
    process, base = server
    family = psutil.Process(process.pid).children(recursive=True)
    started: list[int] = []
    async with aiohttp.ClientSession() as http:
        streams = [asyncio.create_task(read_stream(http, base + CHAT, long_chat(200), started)) for _ in range(30)]
        while len(started) < 30:
            assert not any(s.done() for s in streams), [s.result() for s in streams if s.done()][:1]
            await asyncio.sleep(0.1)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with http.get(f"{base}/health") as r:
            assert r.status == 503
        async with http.post(base + CHAT, json=long_chat(4, stream=False)) as r:
            assert r.status == 503 and (await r.json())["error"]["type"] == "service_unavailable"
        results = await asyncio.gather(*streams)
    assert all(r["status"] == 200 and ended_well(r["events"]) for r in results)
    assert any("error" in json.loads(r["events"][-2]) for r in results)
    process.wait(timeout=SHUTDOWN_TIMEOUT_S + 5)
    _, alive = psutil.wait_procs(family, timeout=max(0.1, SHUTDOWN_TIMEOUT_S + 5 - (time.monotonic() - signalled)))
    assert not alive, f"orphans left: {alive}"
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT_S + 5


@pytest.fixture(scope="module")
def overloaded():
    port = free_port()
    # The header deadline (--timeout-keep-alive) runs from accept and has its own test
    # (test_limits). Here one Python client opens 2,000 connections at once and took up to 1.5 s
    # to write its last request on an idle 2-core machine; on a loaded CI machine one connection
    # was closed before its request was written ("Can not write request body"), which only that
    # deadline does.
    with serve(port, "--max-num-seqs", "4", "--max-num-queued-reqs", "16", "--timeout-keep-alive", "30") as process:
        yield process, f"http://127.0.0.1:{port}"


async def test_300_streams_against_a_bounded_queue(overloaded):
    _, base = overloaded
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        before = await scrape(http, base)
        body = {"prompt": "The sea is", "max_tokens": 8, "ignore_eos": True, "stream": True}
        results = await asyncio.gather(*[read_stream(http, base + COMPLETIONS, body) for _ in range(300)])
        after = await wait_idle(http, base)
    served = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 503]
    assert len(served) + len(refused) == 300 and served and refused
    assert all(ended_well(r["events"]) and '"finish_reason":"length"' in r["events"][-2] for r in served)
    assert all(r["retry_after"] and r["error"]["code"] == "server_overloaded"
               and set(r["error"]) == {"message", "type", "param", "code"} for r in refused)
    key = next(k for k in after if k.startswith("pagedserve:request_rejected_total{") and "queue_full" in k)
    assert after[key] - before.get(key, 0) == len(refused)


async def test_a_2000_request_burst_gets_no_500_and_no_reset(overloaded):
    _, base = overloaded
    raise_open_files_limit()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one() -> int | str:
            try:
                async with http.post(base + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2}) as r:
                    await r.read()
                    return r.status
            except aiohttp.ClientError as e:
                return repr(e)

        results = await asyncio.gather(*[one() for _ in range(2000)])
        await wait_idle(http, base)
    assert set(results) <= {200, 503}, {r for r in results if r not in (200, 503)}
    assert 200 in results


async def test_a_split_deployment_survives_restarted_executor_and_scheduler(tmp_path):
    """Three processes as compose runs them: the executor is SIGKILLed and started again, then the
    scheduler; each time in-flight requests end with an error, /health goes 503 then 200, and a new
    request succeeds, with no other process restarted and no traceback in the logs."""
    executor_port, scheduler_port, port = free_port(), free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "services.log", "w+")
    services = {
        "executor": (["executor", "--address", f"127.0.0.1:{executor_port}", "--num-gpu-blocks-override", "256",
                      "--max-model-len", "1024"], grpc_ready(f"127.0.0.1:{executor_port}")),
        "scheduler": (["scheduler", "--address", f"127.0.0.1:{scheduler_port}", "--executor-address",
                       f"127.0.0.1:{executor_port}"], grpc_ready(f"127.0.0.1:{scheduler_port}")),
        "gateway": (["gateway", "--port", str(port), "--scheduler-address", f"127.0.0.1:{scheduler_port}"],
                    http_ready(f"{base}/health")),
    }
    with ExitStack() as stack:
        def start(name: str) -> subprocess.Popen:
            argv, ready = services[name]
            return stack.enter_context(pagedserve([*argv, "--log-level", "warning"], ready, stdout=log, stderr=log))

        processes = {name: start(name) for name in services}
        async with aiohttp.ClientSession() as http:
            for name in ("executor", "scheduler"):
                started: list[int] = []
                streams = [asyncio.create_task(read_stream(http, base + CHAT, long_chat(500), started))
                           for _ in range(2)]
                while len(started) < 2:
                    await asyncio.sleep(0.1)
                processes[name].kill()
                processes[name].wait()
                for result in await asyncio.gather(*streams):
                    assert ended_well(result["events"]) and "error" in json.loads(result["events"][-2])
                await wait_health(http, base, 503)
                processes[name] = start(name)
                await wait_health(http, base, 200)
                async with http.post(base + CHAT, json=long_chat(4, stream=False)) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["usage"]["completion_tokens"] == 4
        assert all(p.poll() is None for p in processes.values())
    log.seek(0)
    assert "Traceback" not in log.read()

