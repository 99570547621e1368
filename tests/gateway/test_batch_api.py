"""The Files and Batch APIs against the fake engine: files, limits, pagination, validation, line
errors, cancel, the line format, background requests, resume after a restart, metrics and the log."""
import asyncio
import io
import json

import openai
import pytest

from tests.gateway.fake_engine import MODEL

CHAT = [{"role": "user", "content": "Say hello"}]
FINAL = ("completed", "failed", "expired", "cancelled")


def chat_line(custom_id: str, max_tokens: int = 4, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, **body}}


def jsonl(lines: list) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


@pytest.fixture
async def batch_url(serve, tmp_path):
    return await serve(batch_dir=tmp_path / "batches")


@pytest.fixture
async def sdk(batch_url):
    async with openai.AsyncOpenAI(base_url=f"{batch_url}/v1", api_key="none", max_retries=0) as c:
        yield c


async def run_batch(sdk, lines: list, endpoint: str = "/v1/chat/completions", wait: bool = True):
    file = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = await sdk.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h",
                                     metadata={"job": "test"})
    assert batch.status == "validating" and batch.input_file_id == file.id and batch.metadata == {"job": "test"}
    return await finished(sdk, batch.id) if wait else batch


async def finished(sdk, batch_id: str):
    for _ in range(1000):
        batch = await sdk.batches.retrieve(batch_id)
        if batch.status in FINAL:
            return batch
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch still {batch.status}")


async def lines_of(sdk, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in (await sdk.files.content(file_id)).content.splitlines()]


async def test_files_crud_and_pagination(sdk):
    made = [await sdk.files.create(file=(f"f{i}.jsonl", io.BytesIO(jsonl([chat_line("a")]))), purpose="batch")
            for i in range(3)]
    assert made[0].id.startswith("file-") and made[0].filename == "f0.jsonl" and made[0].purpose == "batch"
    assert made[0].bytes == len(jsonl([chat_line("a")]))
    assert (await sdk.files.retrieve(made[1].id)).filename == "f1.jsonl"
    page = await sdk.files.list(limit=2)
    assert [f.id for f in page.data] == [made[2].id, made[1].id] and page.has_more
    rest = await sdk.files.list(limit=2, after=page.data[-1].id)
    assert [f.id for f in rest.data] == [made[0].id] and not rest.has_more
    assert [f.id for f in (await sdk.files.list(order="asc")).data] == [f.id for f in made]
    assert (await sdk.files.list(purpose="batch_output")).data == []
    assert len((await sdk.files.list(purpose="batch")).data) == 3
    assert (await sdk.files.content(made[0].id)).content == jsonl([chat_line("a")])
    deleted = await sdk.files.delete(made[0].id)
    assert deleted.deleted and deleted.id == made[0].id
    with pytest.raises(openai.NotFoundError, match="No such File object"):
        await sdk.files.retrieve(made[0].id)
    with pytest.raises(openai.NotFoundError):
        await sdk.files.content(made[0].id)


async def test_upload_limits(serve, tmp_path):
    url = await serve(batch_dir=tmp_path, batch_max_file_mb=1)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as sdk:
        with pytest.raises(openai.APIStatusError, match="larger than 1 MiB") as e:
            await sdk.files.create(file=("big.jsonl", io.BytesIO(b"x" * (1 << 20) + b"y")), purpose="batch")
        assert e.value.status_code == 413
        with pytest.raises(openai.BadRequestError, match="more than 50000 lines"):
            await sdk.files.create(file=("long.jsonl", io.BytesIO(b"{}\n" * 50_001)), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await sdk.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="assistants")
        assert (await sdk.files.list()).data == []
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == []


async def test_a_batch_answers_each_line_as_the_route_does_as_background_work(sdk, engine):
    lines = [chat_line(f"req-{i}", max_tokens=3 + i) for i in range(3)]
    batch = await run_batch(sdk, lines)
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 3, 0)
    assert batch.in_progress_at and batch.completed_at and batch.expires_at == batch.created_at + 24 * 3600
    assert all(r.background for r in engine.requests)
    out = await lines_of(sdk, batch.output_file_id)
    assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-2"]
    for line, o in zip(lines, out):
        assert o["error"] is None and o["id"].startswith("batch_req_")
        assert o["response"]["status_code"] == 200 and o["response"]["request_id"] == o["id"]
        online = (await sdk.chat.completions.create(**line["body"])).model_dump(exclude_unset=True)
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["choices"] == online["choices"] and body["usage"] == online["usage"]
    assert not engine.requests[-1].background


async def test_completions_and_embeddings_batches(embedder, sdk):
    prompt = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": "Once", "max_tokens": 2}}
    batch = await run_batch(sdk, [prompt], "/v1/completions")
    out, = await lines_of(sdk, batch.error_file_id)
    # The embedder serves no completions: the route's own 400, in the error file.
    assert out["response"]["status_code"] == 400 and "runner" in out["response"]["body"]["error"]["message"]
    embed = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "hi"}}
    batch = await run_batch(sdk, [embed], "/v1/embeddings")
    out, = await lines_of(sdk, batch.output_file_id)
    assert out["response"]["body"]["object"] == "list" and len(out["response"]["body"]["data"][0]["embedding"]) == 8
    assert embedder.pool_requests[-1].background


async def test_rerank_and_score_batches_answer_as_their_routes(reranker, sdk, batch_url, http):
    rerank = {"model": MODEL, "query": "hello", "documents": ["hello there", "goodbye", "hi"], "top_n": 2}
    score = {"model": MODEL, "text_1": "hello", "text_2": ["hello there", "goodbye"]}
    for endpoint, body in (("/v1/rerank", rerank), ("/v1/score", score)):
        before = len(reranker.pool_requests)
        batch = await run_batch(sdk, [{"custom_id": "x", "method": "POST", "url": endpoint, "body": body}], endpoint)
        assert batch.status == "completed", batch
        out, = await lines_of(sdk, batch.output_file_id)
        batched = len(reranker.pool_requests)
        async with http.post(f"{batch_url}{endpoint}", json=body) as r:
            online = await r.json()
        key = "results" if endpoint == "/v1/rerank" else "data"
        assert out["response"]["body"][key] == online[key] and out["response"]["body"]["usage"] == online["usage"]
        calls = reranker.pool_requests
        assert batched > before and all(c.background for c in calls[before:batched])
        assert not any(c.background for c in calls[batched:])


async def test_a_malformed_file_fails_the_batch_at_validation(sdk):
    lines = [chat_line("a"), chat_line("a"), {**chat_line("b"), "url": "/v1/completions"},
             b"not json", {**chat_line("c"), "method": "GET"}, {"custom_id": "d"}]
    batch = await run_batch(sdk, lines)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    errors = [(e.code, e.line) for e in batch.errors.data]
    assert errors == [("duplicate_custom_id", 2), ("mismatched_endpoint", 3), ("invalid_json_line", 4),
                      ("invalid_method", 5), ("invalid_json_line", 6)]


async def test_bad_lines_go_to_the_error_file_and_the_rest_runs(sdk):
    lines = [chat_line("good"), chat_line("bad", max_tokens=-1), chat_line("worse", messages="no"),
             chat_line("streamed", stream=True)]
    batch = await run_batch(sdk, lines)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 1, 3)
    assert [o["custom_id"] for o in await lines_of(sdk, batch.output_file_id)] == ["good"]
    errors = await lines_of(sdk, batch.error_file_id)
    assert [(o["custom_id"], o["response"]["status_code"]) for o in errors] == [
        ("bad", 400), ("worse", 400), ("streamed", 400)]
    assert errors[0]["response"]["body"]["error"]["param"] == "max_tokens"


async def test_create_refuses_what_openai_refuses(sdk):
    file = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("a")]))), purpose="batch")
    for args, param in [(dict(endpoint="/v1/responses"), "endpoint"), (dict(completion_window="1h"),
                                                                        "completion_window"),
                        (dict(input_file_id="file-nope"), "input_file_id")]:
        with pytest.raises(openai.BadRequestError) as e:
            await sdk.batches.create(**{"input_file_id": file.id, "endpoint": "/v1/chat/completions",
                                        "completion_window": "24h", **args})
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError, match="No such Batch"):
        await sdk.batches.retrieve("batch_nope")


async def test_batches_list_pages_newest_first(sdk):
    made = [await run_batch(sdk, [chat_line("a")]) for _ in range(3)]
    page = await sdk.batches.list(limit=2)
    assert [b.id for b in page.data] == [made[2].id, made[1].id] and page.has_more
    assert page.first_id == made[2].id and page.last_id == made[1].id
    rest = await sdk.batches.list(limit=2, after=page.last_id)
    assert [b.id for b in rest.data] == [made[0].id] and not rest.has_more
    assert rest.data[0].status == "completed"


async def test_cancel_stops_new_lines_and_reports_counts(serve, tmp_path, engine):
    engine.delay = 0.02
    url = await serve(batch_dir=tmp_path, batch_concurrency=2)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as sdk:
        batch = await run_batch(sdk, [chat_line(f"r{i}", max_tokens=5) for i in range(40)], wait=False)
        while (await sdk.batches.retrieve(batch.id)).request_counts.completed < 2:
            await asyncio.sleep(0.02)
        cancelled = await sdk.batches.cancel(batch.id)
        assert cancelled.status in ("cancelling", "cancelled")
        batch = await finished(sdk, batch.id)
        assert batch.status == "cancelled" and batch.cancelled_at and batch.cancelling_at
        counts = batch.request_counts
        assert counts.total == 40 and 2 <= counts.completed < 40 and counts.failed == 0
        out = await lines_of(sdk, batch.output_file_id)
        assert len(out) == counts.completed
        sent = len(engine.requests)
        await asyncio.sleep(0.2)
        assert len(engine.requests) == sent
        with pytest.raises(openai.ConflictError, match="cancelled"):
            await sdk.batches.cancel(batch.id)


async def test_a_restarted_gateway_resumes_and_answers_each_line_once(serve, tokenizer, tmp_path, engine):
    from tests.gateway.fake_engine import serve_live_gateway
    engine.delay = 0.01
    runner, url = await serve_live_gateway(tokenizer, engine.address, batch_dir=tmp_path, batch_concurrency=3)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as sdk:
        batch = await run_batch(sdk, [chat_line(f"r{i}", max_tokens=5) for i in range(30)], wait=False)
        while (await sdk.batches.retrieve(batch.id)).request_counts.completed < 5:
            await asyncio.sleep(0.02)
    await runner.cleanup()
    stopped = len(engine.requests)
    url = await serve(batch_dir=tmp_path, batch_concurrency=3)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as sdk:
        batch = await finished(sdk, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 30
        out = await lines_of(sdk, batch.output_file_id)
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(30)]
    # Only the lines unanswered at the stop ran again.
    assert len(engine.requests) - stopped < 30 - 5 + 3


async def test_metrics_and_the_request_log_mark_batch_lines(serve, tmp_path, http, capsys):
    url = await serve(batch_dir=tmp_path, log_requests=True)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as sdk:
        batch = await run_batch(sdk, [chat_line("one", max_tokens=3)])
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    assert "pagedserve:batch_generation_tokens_total 3.0" in text
    assert 'pagedserve:batch_lines{state="queued"} 0.0' in text
    assert f'pagedserve:batch_time_to_first_token_seconds_count{{model_name="{MODEL}"}} 1.0' in text
    assert f'vllm:time_to_first_token_seconds_count{{model_name="{MODEL}"}} 0.0' in text
    captured = capsys.readouterr()
    logged = [line for line in (captured.out + captured.err).splitlines() if "request_finished" in line]
    assert len(logged) == 1 and f"batch_id={batch.id}" in logged[0] and "custom_id=one" in logged[0]


async def test_a_second_gateway_on_one_batch_dir_takes_the_batch_api_once_the_first_stops(
        serve, tokenizer, engine, tmp_path, http, monkeypatch):
    from pagedserve.gateway import batch_runner
    from tests.gateway.fake_engine import serve_live_gateway
    monkeypatch.setattr(batch_runner, "_REOPEN_S", 0.05)
    runner, first = await serve_live_gateway(tokenizer, engine.address, batch_dir=tmp_path)
    second = await serve(batch_dir=tmp_path)
    async with http.get(f"{second}/v1/files") as r:
        assert r.status == 503 and "--batch-dir" in (await r.json())["error"]["message"]
    async with http.get(f"{first}/v1/batches") as r:
        assert r.status == 200 and (await r.json())["data"] == []
    await runner.cleanup()
    for _ in range(100):
        async with http.get(f"{second}/v1/files") as r:
            if r.status == 200:
                break
        await asyncio.sleep(0.05)
    assert r.status == 200


async def test_a_line_the_engine_turns_away_for_now_is_retried_not_failed(sdk, engine):
    import grpc
    engine.reject = grpc.StatusCode.RESOURCE_EXHAUSTED
    batch = await run_batch(sdk, [chat_line("a"), chat_line("b")], wait=False)
    while len(engine.requests) < 2:
        await asyncio.sleep(0.02)
    assert (await sdk.batches.retrieve(batch.id)).status == "in_progress"
    engine.reject = None
    batch = await finished(sdk, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2 and batch.request_counts.failed == 0
    assert len(engine.requests) > 2


async def test_a_batch_past_its_window_expires_with_its_unanswered_lines_in_the_error_file(serve, tmp_path, engine,
                                                                                          monkeypatch):
    from pagedserve.gateway import batches_api
    monkeypatch.setitem(batches_api.COMPLETION_WINDOW_S, "24h", 1)
    engine.delay = 0.05
    url = await serve(batch_dir=tmp_path, batch_concurrency=1)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as sdk:
        batch = await run_batch(sdk, [chat_line(f"r{i}", max_tokens=5) for i in range(20)])
        assert batch.status == "expired" and batch.expired_at
        counts = batch.request_counts
        assert counts.total == 20 and counts.completed + counts.failed == 20 and counts.failed > 10
        errors = await lines_of(sdk, batch.error_file_id)
        assert len(errors) == counts.failed and errors[-1]["custom_id"] == "r19"
        assert errors[-1]["error"]["code"] == "batch_expired" and errors[-1]["response"] is None


async def test_the_store_answers_a_line_once_and_keeps_answers_across_a_reopen(tmp_path):
    from pagedserve.gateway.batch_schemas import Batch
    from pagedserve.gateway.batch_store import BatchStore
    store = BatchStore(tmp_path)
    await store.open()
    batch = Batch(id="batch_x", endpoint="/v1/completions", input_file_id="file-x", completion_window="24h",
                  status="in_progress", created_at=1, expires_at=2)
    await store.save_batch(batch)
    await store.start_lines(batch, [(1, "a", b"{}"), (2, "b", b"{}"), (3, "c", b"{}")])
    assert await store.answer("batch_x", 2, b'{"first": 1}', False)
    assert not await store.answer("batch_x", 2, b'{"second": 1}', False)
    await store.close()
    store = BatchStore(tmp_path)
    await store.open()
    assert [line[1] for line in await store.unanswered("batch_x")] == ["a", "c"]
    assert (await store.batch("batch_x")).request_counts.completed == 1
    assert await store.unfinished() == ["batch_x"]
    await store.close()


async def test_a_batch_dir_that_cannot_be_made_leaves_the_other_routes_serving(serve, tmp_path, http):
    (tmp_path / "file").write_text("")
    url = await serve(batch_dir=tmp_path / "file" / "batches")
    async with http.get(f"{url}/v1/batches") as r:
        assert r.status == 503 and "writable --batch-dir" in (await r.json())["error"]["message"]
    async with http.post(f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 2}) as r:
        assert r.status == 200
