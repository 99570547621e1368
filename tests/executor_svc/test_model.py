import random

import pytest
import torch
import transformers

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.model_config import load_model_config
from pagedserve.executor_svc.models import build_model
from tests.executor_svc.harness import paged_prefill_logits
from tests.tiny_models import ARCHITECTURES, make_tiny_model


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_model(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def test_prefill_logits_match_transformers(tiny_model):
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (7, 30, 1, 19)]
    ours = paged_prefill_logits(tiny_model, prompts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    for prompt, logits in zip(prompts, ours):
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0]
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_tied_embeddings_have_no_lm_head(tmp_path):
    path = make_tiny_model("Qwen2ForCausalLM", tmp_path)
    config = load_model_config(path)
    model = build_model(config, TorchAttentionBackend(), 64)
    names = {name for name, _ in model.named_parameters()}
    assert config.tie_word_embeddings and "lm_head.weight" not in names
    assert "model.layers.0.self_attn.qkv_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
