"""`pagedserve serve --enable-lora --lora-modules` on a tiny Llama, as vLLM's users run it: /v1/models
lists the adapters, and requests naming an adapter or the base model, sent at once (so that the
steps mix them, two adapters a step at most), each get transformers' greedy tokens on the model with
that adapter merged (W + scaling * B @ A) or on the base model."""
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import transformers

from pagedserve.common.model_shapes import write_tokenizer
from pagedserve.entrypoints.launcher import http_ready
from tests.executor_svc.test_lora import ADAPTERS, adapted
from tests.serving import free_port, pagedserve
from tests.tiny_models import COMMON, make_tiny_model, mixed_prompts

NEW_TOKENS = 12
BASE = "tiny"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    path = make_tiny_model("LlamaForCausalLM", root / "model")
    write_tokenizer(path, COMMON["vocab_size"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = mixed_prompts(1)[:4]
    adapters, expected = adapted(root, hf, prompts, NEW_TOKENS)
    expected[BASE] = expected.pop("")
    port = free_port()
    argv = ["serve", str(path), "--served-model-name", BASE, "--port", str(port), "--device", "cpu",
            "--block-size", "4", "--num-gpu-blocks-override", "128", "--max-model-len", "128",
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
            "--lora-modules", *(f"{name}={adapter}" for name, adapter in adapters.items())]
    with pagedserve(argv, http_ready(f"http://127.0.0.1:{port}/health")):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0,
                               timeout=120)
        yield client, prompts, expected


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> list[int]:
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.model == model
    return [int(word[1:]) for word in reply.choices[0].text.split()]


def test_models_lists_the_adapters_under_the_base(case):
    client, _, _ = case
    cards = client.models.list().data
    assert [(c.id, getattr(c, "parent", None)) for c in cards] == [(BASE, None)] + [(n, BASE) for n in ADAPTERS]


def test_adapter_and_base_requests_at_once_get_their_own_greedy_tokens(case):
    client, prompts, expected = case
    jobs = [(model, i) for model in (BASE, *ADAPTERS) for i in range(len(prompts))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: complete(client, job[0], prompts[job[1]]), jobs))
    assert got == [expected[model][i] for model, i in jobs]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-an-adapter", prompt=prompts[0], max_tokens=1)
