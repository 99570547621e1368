"""`pagedserve bench batch`: interactive latency with and without a Batch API job beside it.

Against a running server: one interactive level (bench serve's, streamed /v1/completions) alone;
then a batch of --batch-lines /v1/completions lines is uploaded and started, its output rate is
read alone over --window seconds, and the same interactive level runs again beside it. The
server's generated-token counter, scraped around each phase, gives the batch's tokens: all of
them while it runs alone, the counter's rise less the interactive level's own tokens beside it.
The batch is cancelled at the end.
"""
import argparse
import asyncio
import json
import time

import aiohttp

from pagedserve.bench import serve as bench_serve, workload

GENERATED = "pagedserve:generation_tokens_total"
POLL_S = 0.5


def add_batch_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="interactive latency beside a running Batch API job")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="defaults to the first model of /v1/models")
    p.add_argument("--api-key", help="sent as a bearer token")
    p.add_argument("--vocab-size", type=int, default=workload.VOCAB)
    p.add_argument("--concurrency", type=int, default=10, help="interactive streams")
    p.add_argument("--num-prompts", type=int, default=100, help="interactive requests per level")
    p.add_argument("--batch-lines", type=int, default=2000)
    p.add_argument("--window", type=float, default=15.0, help="seconds the batch runs alone, measured")
    bench_serve.add_sampling_args(p)  # for the interactive requests and the batch's lines alike
    p.add_argument("--output-json", help="also write the results here")
    p.set_defaults(run=run_batch_bench)


def run_batch_bench(args: argparse.Namespace) -> None:
    """Runs the three phases and prints one JSON object of their figures."""
    result = asyncio.run(measure(args))
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


async def measure(args: argparse.Namespace) -> dict:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        target = await bench_serve.resolve_target(session, args)
        alone = await interactive(session, target, args, seed=0)
        batch_id = await start_batch(session, target, args)
        await wait_running(session, target, batch_id)
        tokens, seconds = await generated_during(session, target, asyncio.sleep(args.window))
        batch_alone = tokens / seconds
        level = asyncio.ensure_future(interactive(session, target, args, seed=1))
        tokens, seconds = await generated_during(session, target, level)
        beside = level.result()
        batch_beside = (tokens - beside["output_tokens"]) / seconds
        counts = await cancel(session, target, batch_id)
    left = batch_alone - beside["output_throughput"]
    return dict(bench="batch", model=target.model, sampling=target.sampling, concurrency=args.concurrency,
                batch_lines=args.batch_lines,
                interactive_alone=pick(alone), interactive_beside_batch=pick(beside),
                ttft_p50_ratio=round(beside["ttft_ms"]["median"] / alone["ttft_ms"]["median"], 3),
                tpot_mean_ratio=round(beside["tpot_ms"]["mean"] / alone["tpot_ms"]["mean"], 3),
                batch_alone_tok_s=round(batch_alone, 1), batch_beside_tok_s=round(batch_beside, 1),
                batch_share_of_capacity_left=round(batch_beside / left, 3) if left > 0 else None,
                batch_counts_at_cancel=counts)


def pick(level: dict) -> dict:
    return {key: level[key] for key in ("output_throughput", "ttft_ms", "tpot_ms", "completed", "failed")}


async def interactive(session: aiohttp.ClientSession, target: bench_serve.Target, args: argparse.Namespace,
                      seed: int) -> dict:
    work = workload.mixed(n=args.num_prompts, seed=seed, vocab=args.vocab_size)
    return await bench_serve.run_level(session, target, work, args.concurrency, float("inf"), seed)


async def start_batch(session: aiohttp.ClientSession, target: bench_serve.Target, args: argparse.Namespace) -> str:
    """Uploads the batch's lines (the mixed workload, seeded apart from the interactive levels)
    and creates the batch; returns its id."""
    work = workload.mixed(n=args.batch_lines, seed=1000, vocab=args.vocab_size)
    lines = (json.dumps(dict(custom_id=f"line-{i}", method="POST", url="/v1/completions",
                             body=dict(model=target.model, prompt=prompt, max_tokens=out, ignore_eos=True,
                                       **target.sampling)))
             for i, (prompt, out) in enumerate(zip(work.prompts, work.output_lens)))
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", "\n".join(lines).encode(), filename="batch.jsonl", content_type="application/jsonl")
    file = await call(session, "POST", f"{_base(target)}/files", target, data=form)
    batch = await call(session, "POST", f"{_base(target)}/batches", target,
                       json=dict(input_file_id=file["id"], endpoint="/v1/completions", completion_window="24h"))
    return batch["id"]


async def wait_running(session: aiohttp.ClientSession, target: bench_serve.Target, batch_id: str) -> None:
    """Returns once the batch has answered a line: its engine requests fill the server by then."""
    while True:
        batch = await call(session, "GET", f"{_base(target)}/batches/{batch_id}", target)
        if batch["status"] in ("failed", "cancelled", "expired", "completed"):
            raise SystemExit(f"bench batch: the batch ended as {batch['status']} before it was measured: {batch}")
        if batch["request_counts"]["completed"] > 0:
            return
        await asyncio.sleep(POLL_S)


async def generated_during(session: aiohttp.ClientSession, target: bench_serve.Target,
                           phase) -> tuple[float, float]:
    """The server's generated tokens while `phase` runs, and its seconds."""
    before = await generated(session, target)
    start = time.perf_counter()
    await phase
    seconds = time.perf_counter() - start
    return await generated(session, target) - before, seconds


async def generated(session: aiohttp.ClientSession, target: bench_serve.Target) -> float:
    text = await bench_serve.read_metrics(session, target)
    value = None if text is None else bench_serve.parse_metric(text, GENERATED)
    if value is None:
        raise SystemExit(f"bench batch: {target.metrics_url} has no {GENERATED}")
    return value


async def cancel(session: aiohttp.ClientSession, target: bench_serve.Target, batch_id: str) -> dict:
    """Cancels the batch; exits when it had ended already, since then it did not run beside the
    whole interactive level."""
    batch = await call(session, "GET", f"{_base(target)}/batches/{batch_id}", target)
    if batch["status"] != "in_progress":
        raise SystemExit(f"bench batch: the batch was {batch['status']} before the interactive level ended; "
                         "give it more --batch-lines")
    batch = await call(session, "POST", f"{_base(target)}/batches/{batch_id}/cancel", target)
    return batch["request_counts"]


async def call(session: aiohttp.ClientSession, method: str, url: str, target: bench_serve.Target, **kw) -> dict:
    async with session.request(method, url, headers=target.headers, **kw) as reply:
        if reply.status != 200:
            raise SystemExit(f"bench batch: {method} {url} answered HTTP {reply.status}: {(await reply.text())[:300]}")
        return await reply.json()


def _base(target: bench_serve.Target) -> str:
    return target.completions_url.removesuffix("/completions")
