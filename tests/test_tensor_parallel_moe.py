"""Tensor parallelism of the mixture-of-experts families on the CPU over gloo: -tp 2 gives -tp 1's
greedy tokens (Qwen3-MoE; Qwen2-MoE with its shared expert and a dense layer), each rank holds
its slice of every expert's intermediate dim (from safetensors and from a Q8_0 GGUF), and an
expert width that -tp does not divide is refused in one line."""
import pytest
import torch
from safetensors.torch import load_file

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.model_config import load_model_config, model_config_from_dict
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.parallel import shard_config
from pagedserve.executor_svc.weight_loader import checkpoint_targets, load_weights
from tests.test_tensor_parallel import (  # noqa: F401 (collected here, on this file's `model`)
    assert_ranks_hold_slices, keep_torch_threads, rank_model,
    test_each_rank_holds_its_slice_of_every_tensor,
    test_tp2_gives_tp1_greedy_tokens_under_preemption_and_prefix_caching)
from tests.tiny_gguf import Q, write_gguf
from tests.tiny_models import make_tiny_model

ARCHS = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def test_a_rank_holds_half_of_each_expert(tmp_path):
    path = make_tiny_model("Qwen2MoeForCausalLM", tmp_path)
    mlp = rank_model(path, 1).model.layers[0].mlp
    assert mlp.experts.w13.shape == (4, 32, 64) and mlp.experts.w2.shape == (4, 64, 16)
    assert mlp.shared_expert.gate_up_proj.weight.shape == (64, 64)
    assert mlp.gate.weight.shape == (4, 64) and mlp.shared_expert_gate.weight.shape == (1, 64)
    tensors = load_file(path / "model.safetensors")
    up = tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert torch.equal(mlp.experts.w13[3, 16:], up[16:])


def test_gguf_ranks_dequantize_their_rows_of_each_expert(tmp_path):
    # Q8_0 blocks of 32 columns: a rank's half of an expert's down_proj (16 of 32 columns) cuts
    # through blocks, its gate and up rows do not.
    hf = make_tiny_model("Qwen2MoeForCausalLM", tmp_path / "hf", mlp_only_layers=[])
    path = write_gguf(hf, tmp_path / "model.gguf", outtype=Q.Q8_0)
    whole = build_model(load_model_config(path), TorchAttentionBackend(), 64)
    load_weights(whole, path, "auto")
    assert_ranks_hold_slices(path, {name: t.view for name, t in checkpoint_targets(whole).items()})


def test_expert_widths_that_do_not_divide_are_refused_in_one_line():
    config = model_config_from_dict(dict(
        architectures=["Qwen2MoeForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=38))
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 4 does not divide the model's KV heads 2 and "
                                         r"shared expert intermediate size 38; use -tp 1, 2$"):
        shard_config(config, 4)
