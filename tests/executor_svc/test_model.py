import random

import pytest
import torch
import transformers

from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
from executor_svc.kv_cache import allocate_kv_cache
from executor_svc.model_config import load_model_config
from executor_svc.model_runner import default_dtype
from executor_svc.models.llama import LlamaForCausalLM
from executor_svc.weight_loader import load_weights
from tests.tiny_models import ARCHITECTURES, make_tiny_model

BLOCK_SIZE = 8


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_model(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def paged_prefill_logits(path, prompts: list[list[int]], backend=None,
                         device: torch.device = torch.device("cpu"),
                         dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Every prompt's logits at every position, all prompts packed into one flattened batch whose
    KV blocks are shuffled across the cache."""
    config = load_model_config(path)
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(config, backend or TorchAttentionBackend(),
                                 config.max_position_embeddings)
    load_weights(model, path, "auto")
    num_blocks = [-(-len(p) // BLOCK_SIZE) for p in prompts]
    block_ids = list(range(sum(num_blocks) + 3))
    random.Random(0).shuffle(block_ids)
    tables = torch.zeros(len(prompts), max(num_blocks), dtype=torch.int32)
    slots, positions = [], []
    for i, (prompt, n) in enumerate(zip(prompts, num_blocks)):
        table = torch.tensor([block_ids.pop() for _ in range(n)])
        tables[i, :n] = table
        pos = torch.arange(len(prompt))
        slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        positions.append(pos)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)])
    meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(device), seq_lens=lens.to(device),
                             query_start_loc=starts.to(device), block_tables=tables.to(device),
                             max_query_len=int(lens.max()), max_seq_len=int(lens.max()))
    kv_caches = allocate_kv_cache(config, sum(num_blocks) + 3, BLOCK_SIZE, dtype, device)
    with torch.inference_mode():
        hidden = model(torch.tensor(sum(prompts, []), device=device),
                       torch.cat(positions).to(device), kv_caches, meta)
        logits = model.compute_logits(hidden)
    return list(logits.split(lens.tolist()))


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
    model = LlamaForCausalLM(config, TorchAttentionBackend(), 64)
    names = {name for name, _ in model.named_parameters()}
    assert config.tie_word_embeddings and "lm_head.weight" not in names
    assert "model.layers.0.self_attn.qkv_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
