"""Starts `pagedserve serve` (demo model) as a subprocess and talks to it like a user would."""
import os
import signal
import subprocess
import sys
import time

import grpc
import openai
import psutil
import pytest

from pagedserve.common import service
from pagedserve.entrypoints import default_model
from pagedserve.v1 import engine_pb2, engine_pb2_grpc
from tests.serving import free_port, wait_http

MODEL = default_model.NAME
# What a backend service calling the Engine API at --scheduler-address shares with serve.
GRPC_TOKEN = "e2e-grpc-token"


@pytest.fixture(scope="module")
def server():
    port, grpc_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", "serve", "--port", str(port),
         "--scheduler-address", f"127.0.0.1:{grpc_port}", "--num-gpu-blocks-override", "256",
         "--max-model-len", "1024"], env={**os.environ, service.TOKEN_ENV: GRPC_TOKEN})
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process, timeout=180)
        yield dict(process=process, base_url=f"http://127.0.0.1:{port}/v1",
                   grpc=f"127.0.0.1:{grpc_port}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def model_info(address: str) -> engine_pb2.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetModelInfo(
            engine_pb2.GetModelInfoRequest(), timeout=5, metadata=[("authorization", f"Bearer {GRPC_TOKEN}")])


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["base_url"], api_key="EMPTY", max_retries=0, timeout=60)


def test_models_list(server):
    assert [m.id for m in client(server).models.list().data] == [MODEL]


def test_chat_non_stream_and_stream_agree(server):
    c = client(server)
    messages = [{"role": "user", "content": "Hello! How are you today?"}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens >= 1
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                            temperature=0, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_the_first_question_a_newcomer_asks_gets_a_real_answer(server):
    reply = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0)
    assert "Paris" in reply.choices[0].message.content


ORDINARY_PROMPTS = ("Give me a tip for learning to cook.", "What is a good name for a dog?",
                    "Why do leaves change color in autumn?", "How do I boil an egg?",
                    "Describe a sunset in one sentence.", "What is the largest planet?",
                    "Suggest a weekend activity.", "How many days are in a week?",
                    "What does a bee make?", "Write a short greeting for a birthday card.")


def test_ordinary_answers_are_clean_text(server):
    c = client(server)
    for prompt in ORDINARY_PROMPTS:
        text = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=24, temperature=0).choices[0].message.content
        assert text.strip() and "\ufffd" not in text, (prompt, text)
        assert all(ch.isprintable() or ch in "\n\t" for ch in text), (prompt, text)


def test_completions(server):
    reply = client(server).completions.create(model=MODEL, prompt="The quick brown fox",
                                              max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert reply.object == "text_completion"
    assert reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"


def test_logprobs_and_penalties_cross_every_process(server):
    c = client(server)
    messages = [{"role": "user", "content": "Count: one one one one"}]
    args = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True})
    reply = c.chat.completions.create(**args, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 10
    # Greedy: each token is the most likely one, so it heads its own top logprobs.
    assert all(t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
               for t in content)
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 3 for t in content)
    penalised = c.chat.completions.create(**args, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].message.content != reply.choices[0].message.content
    completion = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6,
                                      temperature=0, logprobs=2, extra_body={"min_tokens": 6})
    assert len(completion.choices[0].logprobs.tokens) == completion.usage.completion_tokens == 6


def test_cancelled_stream_frees_its_blocks(server):
    before = model_info(server["grpc"])
    assert before.num_free_blocks == before.num_blocks
    stream = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=900, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 5:
            break
    assert model_info(server["grpc"]).num_running == 1
    stream.close()
    deadline = time.monotonic() + 5
    while (info := model_info(server["grpc"])).num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert info.num_running == 0 and info.num_waiting == 0
    assert info.num_free_blocks == info.num_blocks


def test_sigterm_stops_every_process_quickly(server):
    process = server["process"]
    family = psutil.Process(process.pid).children(recursive=True)
    assert len(family) == 3
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=10)
    gone, alive = psutil.wait_procs(family, timeout=max(0.1, 10 - (time.monotonic() - started)))
    assert not alive, f"orphans left: {alive}"
    assert time.monotonic() - started < 10
