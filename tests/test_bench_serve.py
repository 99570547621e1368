"""`pagedserve bench serve`: its statistics on synthetic timings, and runs against the real stack."""
import argparse
import asyncio
import json
import math
import subprocess
import sys

import aiohttp
import numpy as np
import pytest

from pagedserve.bench.cli import add_bench_args
from pagedserve.bench.serve import (RequestResult, Target, arrival_times, inter_token_latencies, mark_stable,
                                    parse_metric, request_body, resolve_target, sampling_fields, server_vocab_size,
                                    step_stats, step_totals, summarize, time_per_output_token)
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.entrypoints import default_model
from tests.serving import free_port, run_cli, wait_http


def test_one_token_per_chunk_gives_the_chunk_gaps():
    assert inter_token_latencies([0.1, 0.2, 0.4], 3) == pytest.approx([0.1, 0.2])


def test_chunks_carrying_several_tokens_split_their_gap():
    itls = inter_token_latencies([0.1, 0.3, 0.4], 5)
    assert itls == pytest.approx([0.1, 0.1, 0.05, 0.05])
    assert sum(inter_token_latencies([0.1, 0.3, 0.4], 4)) == pytest.approx(0.3)
    assert inter_token_latencies([0.1, 0.3, 0.4], 4) == pytest.approx([0.1, 0.1, 0.1])
    assert inter_token_latencies([0.2], 1) == []


def test_time_per_output_token_excludes_the_first():
    assert time_per_output_token(RequestResult(True, 4, 5, ttft=0.1, latency=0.5)) == pytest.approx(0.1)
    assert time_per_output_token(RequestResult(True, 4, 1, ttft=0.1, latency=0.1)) is None


def test_summary_of_synthetic_requests():
    ok = [RequestResult(True, 10, 3, 0.1, 0.3, [0.1, 0.2, 0.3]),
          RequestResult(True, 20, 3, 0.3, 0.7, [0.3, 0.5, 0.7])]
    failed = RequestResult(prompt_tokens=5, error="HTTP 500: boom")
    s = summarize(ok + [failed], duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert (s["prompt_tokens"], s["output_tokens"]) == (30, 6)
    assert s["output_throughput"] == 3.0 and s["request_throughput"] == 1.0
    assert s["total_token_throughput"] == 18.0
    assert s["ttft_ms"] == {"mean": 200.0, "median": 200.0, "p99": pytest.approx(298.0)}
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert s["itl_ms"]["mean"] == pytest.approx(150.0) and s["itl_ms"]["median"] == pytest.approx(150.0)
    assert s["e2e_latency_ms"]["mean"] == pytest.approx(500.0)
    assert summarize([failed], 1.0)["ttft_ms"] == {"mean": None, "median": None, "p99": None}


def test_stable_needs_no_failures_and_a_bounded_ttft_tail():
    def level(failed, median, p99):
        return {"failed": failed, "ttft_ms": {"median": median, "p99": p99}}
    levels = [level(0, 20.0, 50.0), level(0, 30.0, 199.0), level(0, 80.0, 201.0), level(1, 20.0, 30.0)]
    mark_stable(levels)
    assert [lv["stable"] for lv in levels] == [True, True, False, False]


def test_metric_is_read_from_prometheus_text():
    text = ("# HELP pagedserve:kv_cache_usage_perc KV usage\n"
            "pagedserve:kv_cache_usage_perc_total 9\n"
            'pagedserve:kv_cache_usage_perc{model_name="a"} 0.25\n'
            'pagedserve:kv_cache_usage_perc{model_name="b"} 0.5 1700000000\n')
    assert parse_metric(text, "pagedserve:kv_cache_usage_perc") == 0.5
    assert parse_metric("pagedserve:kv_cache_usage_perc 0.125\n", "pagedserve:kv_cache_usage_perc") == 0.125
    assert parse_metric("other 1\n", "pagedserve:kv_cache_usage_perc") is None


def step_scrape(counts: tuple[int, int, int], sums_s: tuple[float, float, float]) -> str:
    """/metrics text with the schedule, forward and idle step histograms."""
    lines = []
    for part, count, total in zip(("schedule", "forward", "idle"), counts, sums_s):
        name, labels = f"pagedserve:step_{part}_seconds", '{model_name="m"}'
        lines += [f'{name}_bucket{{le="+Inf",model_name="m"}} {count}', f"{name}_count{labels} {count}",
                  f"{name}_sum{labels} {total}"]
    return "\n".join(lines) + "\n"


def test_step_statistics_of_a_level_from_two_scrapes():
    before = step_totals(step_scrape((10, 10, 8), (0.002, 0.5, 0.004)))
    after = step_totals(step_scrape((110, 110, 98), (0.022, 5.5, 0.049)))
    assert step_stats(before, after) == dict(steps=100, schedule_us_mean=200.0, forward_ms_mean=50.0,
                                             idle_us_mean=500.0, idle_pct=1.0)
    no_back_to_back = step_totals(step_scrape((12, 12, 8), (0.003, 0.6, 0.004)))
    s = step_stats(before, no_back_to_back)
    assert s["steps"] == 2 and s["idle_us_mean"] is None and s["idle_pct"] is None


def test_step_statistics_without_the_histograms_are_absent():
    full = step_totals(step_scrape((1, 1, 1), (0.1, 0.1, 0.1)))
    assert step_totals(None) is None
    assert step_totals(step_scrape((1, 1, 1), (0.1, 0.1, 0.1)).replace("idle", "other")) is None
    assert step_stats(None, full) is None and step_stats(full, None) is None


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return parser.parse_args(list(argv))


def sent_fields(args: argparse.Namespace) -> dict:
    """The fields of a request's body beyond those every request carries."""
    body = request_body(Target("c", "m", "model", {}, "d", sampling_fields(args)), [1, 2], 5)
    return {k: v for k, v in body.items() if k not in ("model", "prompt", "max_tokens", "ignore_eos",
                                                       "stream", "stream_options")}


@pytest.mark.parametrize("bench", ["serve", "batch"])
def test_requests_are_greedy_unless_sampling_flags_are_given(bench):
    assert sent_fields(bench_args(bench)) == {"temperature": 0.0}
    sampled = bench_args(bench, "--temperature", "0.8", "--top-p", "0.9", "--top-k", "40", "--min-p", "0.05",
                         "--repetition-penalty", "1.1", "--frequency-penalty", "0.5", "--presence-penalty", "-0.5")
    assert sent_fields(sampled) == {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
                                    "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": -0.5}


def test_poisson_arrivals():
    assert not arrival_times(4, math.inf, 0).any()
    times = arrival_times(20000, 50.0, 0)
    assert (np.diff(times) >= 0).all() and times[-1] / 20000 == pytest.approx(1 / 50, rel=0.05)


@pytest.fixture(scope="module")
def server():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", "--port", str(port),
                                "--num-gpu-blocks-override", "256", "--max-model-len", "256"])
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process, timeout=180)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.kill()
        process.wait()


def test_bench_serve_against_the_default_model(server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    # No --vocab-size: the bench finds the model's on the server (then keeps to the workload's 32000).
    run_cli(["bench", "serve", "--base-url", server, "--num-prompts", "6", "--concurrency", "1,3",
              "--dataset", "random", "--input-len", "16", "--output-len", "8", "--output-json", str(out),
              "--temperature", "1.0", "--top-p", "0.9"])
    result = json.loads(out.read_text())
    assert result["model"] == default_model.NAME
    assert result["sampling"] == {"temperature": 1.0, "top_p": 0.9}
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    for lv in result["levels"]:
        assert (lv["completed"], lv["failed"], lv["errors"]) == (6, 0, [])
        assert (lv["prompt_tokens"], lv["output_tokens"]) == (6 * 16, 6 * 8)
        assert 0 < lv["ttft_ms"]["mean"] <= lv["e2e_latency_ms"]["mean"]
        assert lv["tpot_ms"]["mean"] > 0 and lv["output_throughput"] > 0
        assert lv["kv_cache_usage_peak"] is None or 0 <= lv["kv_cache_usage_peak"] <= 1
        step = lv["step"]
        assert step["steps"] >= 8 and step["schedule_us_mean"] > 0 and step["forward_ms_mean"] > 0
        assert step["idle_us_mean"] > 0 and 0 < step["idle_pct"] < 100
    table = capsys.readouterr().out
    assert "concurrency" in table and "TTFT p99" in table and "idle %" in table and "stable" in table
    assert "temperature 1.0, top_p 0.9" in table


def test_bench_serve_finds_the_vocabulary_and_fails_on_failed_requests(server, tmp_path):
    async def vocab() -> int:
        async with aiohttp.ClientSession() as session:
            return await server_vocab_size(session, await resolve_target(session, bench_args(
                "serve", "--base-url", server)))

    assert asyncio.run(vocab()) == Tokenizer.load(default_model.default_model()).vocab_size
    out = tmp_path / "serve.json"
    # Ids beyond the model's vocabulary (49,152): every request gets a 400.
    with pytest.raises(SystemExit) as failed:
        run_cli(["bench", "serve", "--base-url", server, "--num-prompts", "2", "--concurrency", "1",
                 "--dataset", "random", "--input-len", "4", "--output-len", "2", "--vocab-size", "200000",
                 "--output-json", str(out)])
    assert str(failed.value).startswith("bench serve: 2 of 2 requests failed; the first error: HTTP 400")
    assert json.loads(out.read_text())["levels"][0]["failed"] == 2
