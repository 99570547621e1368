"""`pagedserve bench serve`: online serving figures of a running server, measured on the wire.

For each concurrency level, that many workers pull requests of a seeded workload in order (each
waits for its Poisson arrival time when --request-rate is finite) and stream them from
/v1/completions as token-id prompts. A level is *stable* when no request failed and its p99 TTFT
is at most STABLE_TTFT_FACTOR times the lowest median TTFT of the sweep: queueing, not prefill,
sets the tail once the server is past what it can sustain. The server's step histograms, scraped
from /metrics before and after each level, give that level's mean step parts and the share of the
executor's time spent idle waiting for the next plan.
"""
import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import aiohttp
import msgspec
import numpy as np
from tqdm import tqdm

from pagedserve.bench import workload

STABLE_TTFT_FACTOR = 10.0
KV_METRIC = "pagedserve:kv_cache_usage_perc"
KV_POLL_S = 0.5
STEP_METRICS = {"schedule": "pagedserve:step_schedule_seconds", "forward": "pagedserve:step_forward_seconds",
                "idle": "pagedserve:step_idle_seconds"}


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    # Arrival of each chunk that carries a choice, in seconds since the request was sent.
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass(slots=True)
class Target:
    completions_url: str
    metrics_url: str
    model: str
    headers: dict[str, str]
    detokenize_url: str
    # The sampling fields every request carries (sampling_fields).
    sampling: dict[str, float | int]


def add_serve_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="online serving benchmark against a running server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="defaults to the first model of /v1/models")
    p.add_argument("--api-key", help="sent as a bearer token")
    p.add_argument("--dataset", choices=["mixed", "random"], default="mixed")
    p.add_argument("--input-len", type=int, default=1024, help="random dataset only")
    p.add_argument("--output-len", type=int, default=1024, help="random dataset only")
    p.add_argument("--dataset-seed", type=int, default=0,
                   help="level i of the sweep uses seed + i, so no level hits another's prefix cache")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn below this; by default below the server's "
                        "vocabulary size (found with /detokenize), at most 32000 as in bench throughput")
    p.add_argument("--num-prompts", type=int, help="per level; default max(100, 5 x concurrency)")
    p.add_argument("--concurrency", type=concurrency_levels, default=[10, 20, 30, 40, 50],
                   help="comma-separated levels, e.g. 10,20,30,40,50")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second; inf sends as fast as the workers allow")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds without a byte")
    add_sampling_args(p)
    p.add_argument("--output-json", help="also write every level's results here")
    p.add_argument("--plot", help="PNG of output throughput and mean TTFT against concurrency "
                                  "(needs matplotlib: pip install 'pagedserve[plot]')")
    p.set_defaults(run=run_serve_bench)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """vLLM's bench sampling flags: greedy unless --temperature is given; the others are sent only
    when given, so the server's defaults apply."""
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    for penalty in SAMPLING_PENALTIES:
        p.add_argument(f"--{penalty.replace('_', '-')}", type=float)


SAMPLING_PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty")


def sampling_fields(args: argparse.Namespace) -> dict[str, float | int]:
    names = ("temperature", "top_p", "top_k", "min_p", *SAMPLING_PENALTIES)
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def concurrency_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 10,20,30, got {text!r}")
    return levels


def run_serve_bench(args: argparse.Namespace) -> None:
    """Runs the sweep and reports it; exits non-zero when any request failed."""
    if args.plot:
        require_matplotlib()
    result = asyncio.run(sweep(args))
    print_table(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    failed = sum(lv["failed"] for lv in result["levels"])
    if failed:
        first = next(e for lv in result["levels"] for e in lv["errors"])
        total = sum(lv["num_prompts"] for lv in result["levels"])
        raise SystemExit(f"bench serve: {failed} of {total} requests failed; the first error: {first}")


async def sweep(args: argparse.Namespace) -> dict:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout)
    # limit=0: the connector would otherwise queue requests beyond 100 connections.
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        target = await resolve_target(session, args)
        if args.vocab_size is None:
            args.vocab_size = min(workload.VOCAB, await server_vocab_size(session, target))
        levels = []
        for i, concurrency in enumerate(args.concurrency):
            num_prompts = args.num_prompts or max(100, 5 * concurrency)
            work = build_workload(args, num_prompts, args.dataset_seed + i)
            levels.append(await run_level(session, target, work, concurrency, args.request_rate,
                                          seed=args.dataset_seed + i))
    mark_stable(levels)
    return dict(bench="serve", base_url=args.base_url, model=target.model, dataset=args.dataset,
                input_len=args.input_len if args.dataset == "random" else None,
                output_len=args.output_len if args.dataset == "random" else None,
                request_rate=args.request_rate if math.isfinite(args.request_rate) else "inf",
                sampling=target.sampling,
                stable_rule=f"no failed request and p99 TTFT <= {STABLE_TTFT_FACTOR:g} x the sweep's "
                            "lowest median TTFT",
                date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), levels=levels)


def build_workload(args: argparse.Namespace, num_prompts: int, seed: int) -> workload.Workload:
    if args.dataset == "mixed":
        return workload.mixed(n=num_prompts, seed=seed, vocab=args.vocab_size)
    return workload.random(n=num_prompts, input_len=args.input_len, output_len=args.output_len, seed=seed,
                           vocab=args.vocab_size)


async def resolve_target(session: aiohttp.ClientSession, args: argparse.Namespace) -> Target:
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        async with session.get(f"{base}/models", headers=headers) as reply:
            reply.raise_for_status()
            model = (await reply.json())["data"][0]["id"]
    root = base.removesuffix("/v1")
    return Target(f"{base}/completions", f"{root}/metrics", model, headers, f"{root}/detokenize",
                  sampling_fields(args))


async def server_vocab_size(session: aiohttp.ClientSession, target: Target) -> int:
    """The number of token ids the server takes: the first id /detokenize refuses, found by
    doubling and then bisecting (a few dozen small requests)."""
    async def valid(token_id: int) -> bool:
        body = dict(model=target.model, tokens=[token_id])
        async with session.post(target.detokenize_url, json=body, headers=target.headers) as reply:
            if reply.status not in (200, 400):
                raise SystemExit(f"bench serve: {target.detokenize_url} answered HTTP {reply.status}; "
                                 "pass --vocab-size")
            return reply.status == 200

    if not await valid(0):
        raise SystemExit(f"bench serve: {target.detokenize_url} refuses token id 0; pass --vocab-size")
    low, high = 0, 1
    while await valid(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if await valid(mid) else (low, mid)
    return high


async def run_level(session: aiohttp.ClientSession, target: Target, work: workload.Workload,
                    concurrency: int, rate: float, seed: int) -> dict:
    n = len(work.prompts)
    arrivals = arrival_times(n, rate, seed)
    results: list[RequestResult | None] = [None] * n
    pending = iter(range(n))
    bar = tqdm(total=n, desc=f"concurrency {concurrency}", unit="req")
    steps_before = step_totals(await read_metrics(session, target))
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_kv_usage(session, target, stop))
    start = time.perf_counter()

    async def worker() -> None:
        for i in pending:  # shared by the workers: each request is taken once, in order
            delay = start + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            results[i] = await send(session, target, work.prompts[i], work.output_lens[i])
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    duration = time.perf_counter() - start
    stop.set()
    kv_peak = await watcher
    steps_after = step_totals(await read_metrics(session, target))
    bar.close()
    return dict(concurrency=concurrency, num_prompts=n, **summarize(results, duration),
                kv_cache_usage_peak=kv_peak, step=step_stats(steps_before, steps_after))


def arrival_times(n: int, rate: float, seed: int) -> np.ndarray:
    """Seconds from the level's start at which each request may be sent."""
    if math.isinf(rate):
        return np.zeros(n)
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, size=n))


async def send(session: aiohttp.ClientSession, target: Target, prompt: list[int], output_len: int) -> RequestResult:
    body = request_body(target, prompt, output_len)
    result = RequestResult(prompt_tokens=len(prompt))
    start = time.perf_counter()
    try:
        async with session.post(target.completions_url, json=body, headers=target.headers) as reply:
            if reply.status != 200:
                result.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                return result
            await read_stream(reply, result, start)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def request_body(target: Target, prompt: list[int], output_len: int) -> dict:
    return dict(model=target.model, prompt=prompt, max_tokens=output_len, ignore_eos=True,
                stream=True, stream_options=dict(include_usage=True), **target.sampling)


async def read_stream(reply: aiohttp.ClientResponse, result: RequestResult, start: float) -> None:
    usage = None
    async for line in reply.content:
        if not line.startswith(b"data: "):
            continue
        now = time.perf_counter() - start
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        event = msgspec.json.decode(data)
        if "error" in event:
            result.error = str(event["error"].get("message", event["error"]))
            return
        if event.get("choices"):
            result.chunk_times.append(now)
        usage = event.get("usage") or usage
    if usage is None or not result.chunk_times:
        result.error = "the stream ended without text or usage"
        return
    result.output_tokens = usage["completion_tokens"]
    result.ttft = result.chunk_times[0]
    result.latency = result.chunk_times[-1]
    result.ok = True


def inter_token_latencies(chunk_times: list[float], num_tokens: int) -> list[float]:
    """Per-token gaps after the first chunk. A chunk may carry several tokens (the gateway streams
    text and holds back partial characters) and the stream does not say how many, so the tokens
    after the first are spread evenly over the later chunks and each chunk's gap is split among its
    tokens: the values then add up to the time from the first chunk to the last."""
    gaps = np.diff(chunk_times)
    if not len(gaps):
        return []
    base, extra = divmod(max(num_tokens - 1, len(gaps)), len(gaps))
    itls: list[float] = []
    for i, gap in enumerate(gaps):
        k = base + (i < extra)
        itls += [gap / k] * k
    return itls


def time_per_output_token(result: RequestResult) -> float | None:
    if result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def stats_ms(values_s: list[float]) -> dict:
    if not values_s:
        return dict(mean=None, median=None, p99=None)
    v = np.asarray(values_s) * 1000
    return dict(mean=round(float(v.mean()), 2), median=round(float(np.median(v)), 2),
                p99=round(float(np.percentile(v, 99)), 2))


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [t for t in map(time_per_output_token, ok) if t is not None]
    itls = [x for r in ok for x in inter_token_latencies(r.chunk_times, r.output_tokens)]
    errors = sorted({r.error for r in results if not r.ok})
    return dict(completed=len(ok), failed=len(results) - len(ok), duration_s=round(duration, 3),
                prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                request_throughput=round(len(ok) / duration, 3),
                output_throughput=round(output_tokens / duration, 1),
                total_token_throughput=round((prompt_tokens + output_tokens) / duration, 1),
                ttft_ms=stats_ms([r.ttft for r in ok]), tpot_ms=stats_ms(tpots), itl_ms=stats_ms(itls),
                e2e_latency_ms=stats_ms([r.latency for r in ok]), errors=errors[:5])


def mark_stable(levels: list[dict]) -> None:
    medians = [lv["ttft_ms"]["median"] for lv in levels if lv["ttft_ms"]["median"] is not None]
    for lv in levels:
        p99 = lv["ttft_ms"]["p99"]
        lv["stable"] = bool(lv["failed"] == 0 and p99 is not None
                            and p99 <= STABLE_TTFT_FACTOR * min(medians))


async def watch_kv_usage(session: aiohttp.ClientSession, target: Target, stop: asyncio.Event) -> float | None:
    """Peak of the server's KV cache usage (0 to 1) until `stop`; None if /metrics does not have it."""
    peak = None
    while True:
        value = await read_kv_usage(session, target)
        if value is None:
            return peak
        peak = value if peak is None else max(peak, value)
        try:
            await asyncio.wait_for(stop.wait(), KV_POLL_S)
            return peak
        except asyncio.TimeoutError:
            pass


async def read_kv_usage(session: aiohttp.ClientSession, target: Target) -> float | None:
    text = await read_metrics(session, target)
    return None if text is None else parse_metric(text, KV_METRIC)


async def read_metrics(session: aiohttp.ClientSession, target: Target) -> str | None:
    try:
        async with session.get(target.metrics_url, headers=target.headers) as reply:
            return await reply.text() if reply.status == 200 else None
    except aiohttp.ClientError:
        return None


def step_totals(text: str | None) -> dict[str, tuple[float, float]] | None:
    """(count, sum in seconds) of each step histogram of a scrape; None if any is missing."""
    if text is None:
        return None
    totals = {part: (parse_metric(text, f"{name}_count"), parse_metric(text, f"{name}_sum"))
              for part, name in STEP_METRICS.items()}
    return None if any(None in t for t in totals.values()) else totals


def step_stats(before: dict | None, after: dict | None) -> dict | None:
    """Steps and mean step parts between two step_totals; None when either scrape lacked them."""
    if before is None or after is None:
        return None
    means = {}
    for part in STEP_METRICS:
        count = after[part][0] - before[part][0]
        means[part] = (after[part][1] - before[part][1]) / count if count else None
    schedule, forward, idle = means["schedule"], means["forward"], means["idle"]
    # From the means, not the sums: a step after a pause for lack of work has a forward time but no
    # idle time, and the share should describe back-to-back stepping.
    idle_pct = None if forward is None or idle is None else round(100 * idle / (forward + idle), 1)
    return dict(steps=int(after["schedule"][0] - before["schedule"][0]),
                schedule_us_mean=scaled(schedule, 1e6), forward_ms_mean=scaled(forward, 1e3),
                idle_us_mean=scaled(idle, 1e6), idle_pct=idle_pct)


def scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else round(value * factor, 2)


def parse_metric(text: str, name: str) -> float | None:
    """The largest value of metric `name` in Prometheus text format, over all its label sets."""
    values = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest.startswith("{"):
            rest = rest[rest.index("}") + 1:]
        elif not rest.startswith(" "):
            continue  # another metric whose name starts with `name`
        values.append(float(rest.split()[0]))
    return max(values) if values else None


def print_table(result: dict) -> None:
    sampling = ", ".join(f"{name} {value}" for name, value in result["sampling"].items())
    print(f"\nbench serve: {result['model']} at {result['base_url']}, dataset {result['dataset']}, "
          f"request rate {result['request_rate']}, {sampling}")
    header = (f"{'concurrency':>11} {'ok':>5} {'failed':>6} {'TTFT mean':>10} {'TTFT p99':>9} "
              f"{'TPOT mean':>10} {'out tok/s':>10} {'req/s':>7} {'KV peak':>8} {'idle %':>7} "
              f"{'stable':>6}")
    print(header)
    for lv in result["levels"]:
        kv = "n/a" if lv["kv_cache_usage_peak"] is None else f"{100 * lv['kv_cache_usage_peak']:.1f}%"
        step = lv["step"]
        idle = "n/a" if step is None or step["idle_pct"] is None else f"{step['idle_pct']:.1f}%"
        print(f"{lv['concurrency']:>11} {lv['completed']:>5} {lv['failed']:>6} "
              f"{fmt_ms(lv['ttft_ms']['mean']):>10} {fmt_ms(lv['ttft_ms']['p99']):>9} "
              f"{fmt_ms(lv['tpot_ms']['mean']):>10} {lv['output_throughput']:>10.1f} "
              f"{lv['request_throughput']:>7.2f} {kv:>8} {idle:>7} {'yes' if lv['stable'] else 'NO':>6}")
    print(f"stable: {result['stable_rule']}")
    for lv in result["levels"]:
        for error in lv["errors"]:
            print(f"concurrency {lv['concurrency']} error: {error}")


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}ms"


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib, which is not installed: pip install 'pagedserve[plot]' "
                         "(or drop --plot; --output-json keeps every number)") from None


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    x = [lv["concurrency"] for lv in levels]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(x, [lv["output_throughput"] for lv in levels], "o-", color="tab:blue")
    left.set_xticks(x)
    left.set_xlabel("concurrency")
    left.set_ylabel("output tokens/s", color="tab:blue")
    right = left.twinx()
    right.plot(x, [lv["ttft_ms"]["mean"] for lv in levels], "s--", color="tab:red")
    right.set_ylabel("mean TTFT (ms)", color="tab:red")
    left.set_title(f"{result['model']}: {result['dataset']} workload")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
