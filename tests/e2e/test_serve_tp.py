"""`pagedserve serve -tp 2 --device cpu` on a tiny model: the executor's second rank gives the
greedy tokens of -tp 1 through the OpenAI API, and a rank killed with SIGKILL stops the stack."""
import signal
import subprocess
import sys

import openai
import psutil
import pytest
import torch

from pagedserve import LLM
from pagedserve.common.model_shapes import write_tokenizer
from tests.serving import free_port, wait_http
from tests.tiny_models import COMMON, llm_greedy, make_tiny_model, mixed_prompts

NEW_TOKENS = 32
POOL = ["--block-size", "4", "--num-gpu-blocks-override", "40", "--max-model-len", "128"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))
    write_tokenizer(path, COMMON["vocab_size"])
    return path


@pytest.fixture(scope="module")
def server(model):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", str(model), "--port", str(port),
                                "--device", "cpu", "-tp", "2", *POOL])
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process, timeout=180)
        yield dict(process=process, base_url=f"http://127.0.0.1:{port}/v1")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_tp2_completions_equal_tp1_greedy_tokens(model, server):
    threads = torch.get_num_threads()
    expected = llm_greedy(LLM(str(model), block_size=4, num_gpu_blocks_override=40, max_model_len=128),
                          mixed_prompts(0), NEW_TOKENS)
    torch.set_num_threads(threads)
    client = openai.OpenAI(base_url=server["base_url"], api_key="EMPTY", max_retries=0, timeout=120)
    reply = client.completions.create(model=str(model), prompt=mixed_prompts(0), max_tokens=NEW_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
    tokens = [[int(word[1:]) for word in choice.text.split()]
              for choice in sorted(reply.choices, key=lambda c: c.index)]
    assert tokens == expected


def test_a_killed_rank_stops_every_process(server):
    process = server["process"]
    family = psutil.Process(process.pid).children(recursive=True)
    assert len(family) == 4, "gateway, scheduler, executor and its rank 1"
    rank1 = next(p for p in family if "pagedserve.executor_svc.tp_worker" in " ".join(p.cmdline()))
    rank1.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == 1
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, f"orphans left: {alive}"
