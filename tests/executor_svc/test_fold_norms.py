"""Norms folded into the projections after them (layers/decoder.py's fold_norms): the same logits
as the model unfolded, on the Triton kernels (interpreted on a CPU), and folded only where every
layer allows it."""
import pytest
import torch

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend, TritonAttentionBackend
from pagedserve.executor_svc.device import default_dtype
from pagedserve.executor_svc.layers import decoder
from pagedserve.executor_svc.layers.decoder import fold_norms
from pagedserve.executor_svc.model_config import load_model_config
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.weight_loader import load_weights
from tests.executor_svc.harness import paged_prefill_logits
from tests.kernels.kernel_testing import DEVICE, assert_close
from tests.tiny_models import ARCHITECTURES, make_tiny_model, mixed_prompts

# Plain Llama layers, with or without a sliding window, with q/k norms (Qwen3), a qkv bias (Qwen2)
# or partial rotary (the tiny Phi-3's, as Phi-4-mini's); the others have experts or Gemma's norms.
FOLDING = {"LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
           "Qwen3ForCausalLM"}


@pytest.mark.parametrize("padded", [False, True], ids=["stream", "padded_stream"])
@pytest.mark.parametrize("arch", sorted(FOLDING))
def test_folded_logits_equal_the_unfolded_ones(monkeypatch, tmp_path, arch: str, padded: bool) -> None:
    if padded:
        # As on a GPU, where o_proj and down_proj add into a stream of at least 32 rows.
        monkeypatch.setattr(decoder, "input_rows", lambda projection, num_tokens: num_tokens + 5)
    path = make_tiny_model(arch, tmp_path)
    prompts = mixed_prompts(seed=3)[:4]
    # The unfolded model on the same kernels on a GPU, whose tf32 products need not agree with
    # torch's float32 attention within the tolerance; on torch's on a CPU, where the interpreted
    # Triton kernels would double the test's time and other tests hold them to torch's.
    unfolded = TritonAttentionBackend() if DEVICE.type == "cuda" else TorchAttentionBackend()
    plain = torch.cat(paged_prefill_logits(path, prompts, unfolded, DEVICE))
    folded = torch.cat(paged_prefill_logits(path, prompts, TritonAttentionBackend(), DEVICE, fold=True))
    assert_close(folded, plain)


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "Gemma3ForConditionalGeneration"])
def test_fold_norms_folds_where_every_layer_allows_it(tmp_path, arch: str) -> None:
    path = make_tiny_model(arch, tmp_path)
    config = load_model_config(path)
    with default_dtype(torch.float32):
        model = build_model(config, TritonAttentionBackend(), 64)
        unfolding = build_model(config, TorchAttentionBackend(), 64)
    load_weights(model, path, "auto")
    norm = model.model.layers[0].input_layernorm.weight.detach().clone()
    attn = model.model.layers[0].self_attn
    qkv, bias = attn.qkv_proj.weight.detach().clone(), attn.qkv_proj.bias
    assert fold_norms(model) == (arch in FOLDING)
    assert [layer.folded for layer in model.model.layers] == [arch in FOLDING] * len(model.model.layers)
    if arch in FOLDING:
        assert torch.equal(attn.qkv_proj.weight, qkv * norm)
        # A qkv bias leaves the GEMM for rotary, which adds it after the norm's scale.
        assert attn.qkv_proj.bias is None
        assert attn.folded_bias is None if bias is None else torch.equal(torch.cat(attn.folded_bias), bias)
    assert not fold_norms(unfolding)
