"""`pagedserve serve CHAT --also-serve OTHER`: two tiny models of different architectures and
vocabularies behind one base URL. Each answers under its own names with its own greedy tokens, and
/v1/models lists both. (Issue 27's bar is SmolLM2 chat beside an embedding model and a reranker;
this is its generate-only form.)"""
import subprocess
import sys

import openai
import psutil
import pytest
import torch

from pagedserve import LLM
from pagedserve.common.model_shapes import write_tokenizer
from tests.serving import free_port, wait_http
from tests.tiny_models import llm_greedy, make_tiny_model

NEW_TOKENS = 8
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]
GEOMETRY = dict(block_size=4, num_gpu_blocks_override=40, max_model_len=128)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    chat = make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("chat"))
    write_tokenizer(chat, 512)
    other = make_tiny_model("Qwen3ForCausalLM", tmp_path_factory.mktemp("other"), vocab_size=256)
    write_tokenizer(other, 256)
    return chat, other


@pytest.fixture(scope="module")
def server(models):
    chat, other = models
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", "serve", str(chat), "--port", str(port), "--device", "cpu",
         "--served-model-name", "chat", "--block-size", "4", "--num-gpu-blocks-override", "40",
         "--max-model-len", "128", "--log-level", "warning",
         "--also-serve", f"{other},served-model-name=second,second-alias,max-model-len=64"])
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process, timeout=180)
        yield process, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0,
                                     timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def greedy_text(client: openai.OpenAI, model: str) -> tuple[str, list[list[int]]]:
    reply = client.completions.create(model=model, prompt=PROMPTS, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    tokens = [[int(word[1:]) for word in c.text.split()] for c in sorted(reply.choices, key=lambda c: c.index)]
    return reply.model, tokens


def test_one_base_url_serves_both_models(models, server):
    process, client = server
    assert [(m.id, m.max_model_len) for m in client.models.list().data] == [("chat", 128), ("second", 64)]
    threads = torch.get_num_threads()
    expected = [llm_greedy(LLM(str(path), **GEOMETRY), PROMPTS, NEW_TOKENS) for path in models]
    torch.set_num_threads(threads)
    assert greedy_text(client, "chat") == ("chat", expected[0])
    assert greedy_text(client, "second-alias") == ("second", expected[1])
    assert expected[0] != expected[1]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=str(models[1]), prompt="w5", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="several models"):
        client.completions.create(model="", prompt="w5", max_tokens=1)
    children = psutil.Process(process.pid).children()
    assert len(children) == 5, "the gateway, and an executor and a scheduler per model"
