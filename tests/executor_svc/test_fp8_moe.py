"""FP8 experts (--quantization fp8) on the CPU: each expert quantized per output channel at load,
routers left in the model dtype, tiny MoE models keeping their logits, the engine's greedy tokens,
and a per-channel FP8 checkpoint loading as quantization at load does."""
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from pagedserve import LLM
from pagedserve.executor_svc.fp8 import Fp8Linear
from pagedserve.kernels.reference import FP8_DTYPE, quantize_experts_fp8_ref
from tests.executor_svc.harness import paged_prefill_logits
from tests.executor_svc.test_fp8 import (  # noqa: F401 (collected here, on this file's `qwen2`)
    assert_fp8_keeps_logits, loaded, test_per_channel_compressed_tensors_checkpoint_equals_quantization_at_load)
from tests.tiny_models import llm_greedy, make_tiny_model, mixed_prompts

# Below the dense models' 0.99 (test_fp8): FP8's error moves a token near a tie between experts
# to another expert, whose output differs by far more than the rounding (the worst token of
# Mixtral's 0.75; means measured 0.988 Qwen3-MoE, 0.996 Qwen2-MoE, 0.990 Mixtral).
MIN_COSINE = 0.98


@pytest.fixture(scope="module", params=["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def tiny(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    # Under test_fp8's name for its model with every kind of tensor: here a shared expert too.
    return make_tiny_model("Qwen2MoeForCausalLM", tmp_path_factory.mktemp("qwen2moe"))


def test_tiny_models_with_fp8_experts_keep_their_logits(tiny):
    assert_fp8_keeps_logits(tiny, MIN_COSINE)


def test_experts_are_quantized_per_expert_and_channel_and_routers_are_not(qwen2):
    mlp = loaded(qwen2).model.layers[0].mlp
    source = load_file(qwen2 / "model.safetensors")
    gate, up, down = (torch.stack([source[f"model.layers.0.mlp.experts.{e}.{p}.weight"] for e in range(4)])
                      for p in ("gate_proj", "up_proj", "down_proj"))
    for (weight, scale), expected in (((mlp.experts.w13, mlp.experts.w13_scale), torch.cat([gate, up], 1)),
                                      ((mlp.experts.w2, mlp.experts.w2_scale), down)):
        q, s = quantize_experts_fp8_ref(expected)
        assert weight.dtype == FP8_DTYPE and torch.equal(weight.float(), q.float())
        assert torch.equal(scale, s)
    assert mlp.gate.weight.dtype == mlp.shared_expert_gate.weight.dtype == torch.float32
    assert isinstance(mlp.shared_expert.down_proj, Fp8Linear)


def test_engine_generates_greedily_with_fp8_experts(qwen2):
    """The engine's FP8 decode steps pick what an FP8 prefill over the same context ranks first."""
    prompts = mixed_prompts(1)[:4]
    llm = LLM(str(qwen2), quantization="fp8", max_model_len=256, num_gpu_blocks_override=128, seed=0)
    assert llm.worker.model.model.layers[0].mlp.experts.w13.dtype == FP8_DTYPE
    outputs = llm_greedy(llm, prompts, 12)
    contexts = [p + o for p, o in zip(prompts, outputs)]
    logits = paged_prefill_logits(qwen2, contexts, fp8=True)
    agree = sum(int(t == r) for p, o, l in zip(prompts, outputs, logits)
                for t, r in zip(o, l[len(p) - 1:-1].argmax(-1).tolist()))
    assert agree >= 0.95 * 12 * len(prompts)
    full = torch.cat(paged_prefill_logits(qwen2, contexts))
    assert nn.functional.cosine_similarity(full, torch.cat(logits), dim=-1).mean() >= MIN_COSINE
