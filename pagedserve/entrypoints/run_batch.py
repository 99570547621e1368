"""`pagedserve run-batch -i IN -o OUT`: vLLM's offline batch command. It serves the model as `serve`
does, on a private loopback port with a temporary --batch-dir, and runs the input file there as one
Batch API batch (the gateway's batch runner), showing its progress; the output file holds a line per
request, answered or failed, in the input's order and OpenAI's line format."""
import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

import aiohttp
from tqdm import tqdm

from pagedserve.gateway.batch_schemas import ACTIVE

_POLL_S = 0.5


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, type=Path,
                        help="the requests, one JSON line each: custom_id, method POST, url (one of "
                             "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/rerank, /v1/score, the "
                             "same on every line) and body")
    parser.add_argument("-o", "--output-file", required=True, type=Path,
                        help="where the answers go, one JSON line per request")


def run(args: argparse.Namespace, serve) -> int:
    """Runs the batch on `serve(args, listener)` (cli.run_serve) in this thread; returns the exit code."""
    from pagedserve.entrypoints import preflight
    from pagedserve.gateway.server import api_key
    from pagedserve.gateway import tls
    if tls.argv(args):
        raise ValueError("run-batch talks to its own server on a private loopback port, without HTTPS; drop "
                         "the --ssl-* flags")
    endpoint = _endpoint(args.input_file)
    key = api_key(args)
    args.host = "127.0.0.1"
    listener = preflight.bind(args.host, 0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    with tempfile.TemporaryDirectory(prefix="pagedserve-run-batch-") as folder:
        args.batch_dir = Path(folder)
        outcome: list[int] = []
        client = threading.Thread(target=_client, args=(url, args, endpoint, key, outcome), daemon=True)
        client.start()
        served = serve(args, listener)
        client.join(1.0)
    return outcome[0] if outcome else served or 1


def _endpoint(path: Path) -> str:
    """The url of the file's first request, which every line must share."""
    with open(path, "rb") as given:
        for line in given:
            if line.strip():
                return json.loads(line).get("url", "")
    raise ValueError(f"{path} holds no request; write one JSON request per line")


def _client(url: str, args: argparse.Namespace, endpoint: str, key: str | None, outcome: list[int]) -> None:
    try:
        outcome.append(asyncio.run(_drive(url, args.input_file, args.output_file, endpoint, key)))
    except Exception as e:
        sys.stderr.write(f"pagedserve: error: run-batch: {e}\n")
        outcome.append(1)
    finally:
        # Stops the server, as Ctrl-C would.
        os.kill(os.getpid(), signal.SIGTERM)


async def _drive(url: str, input_file: Path, output_file: Path, endpoint: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(url, headers=headers) as http:
        await _ready(http)
        with open(input_file, "rb") as data:
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", data, filename=input_file.name)
            file = await _json(http.post("/v1/files", data=form))
        batch = await _json(http.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": endpoint,
                                                           "completion_window": "24h"}))
        batch = await _progress(http, batch["id"])
        if batch["status"] != "completed":
            errors = (batch.get("errors") or {}).get("data") or []
            for e in errors:
                sys.stderr.write(f"{input_file}:{e.get('line')}: {e['message']}\n")
            sys.stderr.write(f"pagedserve: error: the batch {batch['status']}\n")
            return 1
        answers = {}
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            if file_id is not None:
                for line in (await (await http.get(f"/v1/files/{file_id}/content")).read()).splitlines():
                    answers[json.loads(line)["custom_id"]] = line
    _write(output_file, _ordered(input_file, answers))
    return 0


async def _ready(http: aiohttp.ClientSession) -> None:
    while True:
        try:
            async with http.get("/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(_POLL_S)


async def _json(call) -> dict:
    async with call as r:
        body = await r.json()
        if r.status != 200:
            raise ValueError(body["error"]["message"])
        return body


async def _progress(http: aiohttp.ClientSession, batch_id: str) -> dict:
    """The batch once it ended, with a progress bar of its answered lines meanwhile."""
    with tqdm(desc="Running batch", unit="req", file=sys.stderr) as bar:
        while True:
            batch = await _json(http.get(f"/v1/batches/{batch_id}"))
            counts = batch["request_counts"]
            bar.total = counts["total"]
            bar.update(counts["completed"] + counts["failed"] - bar.n)
            if batch["status"] not in ACTIVE:
                return batch
            await asyncio.sleep(_POLL_S)


def _ordered(input_file: Path, answers: dict[str, bytes]) -> list[bytes]:
    with open(input_file, "rb") as given:
        ids = [json.loads(line)["custom_id"] for line in given if line.strip()]
    return [answers[i] for i in ids if i in answers]


def _write(output_file: Path, lines: list[bytes]) -> None:
    with open(output_file, "wb") as out:
        for line in lines:
            out.write(line + b"\n")
