"""Loading mixture-of-experts checkpoints: the per-expert tensors of hub checkpoints (Qwen's
`mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`) and transformers 5's
fused `mlp.experts.gate_up_proj` / `down_proj` land in the stacked expert weights, whole or one
rank's slice; dummy weights give finite logits."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.model_config import load_model_config
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.parallel import TensorParallel, shard_config
from pagedserve.executor_svc.weight_loader import checkpoint_targets, load_weights
from tests.executor_svc.harness import paged_prefill_logits
from tests.executor_svc.test_weight_loader import rewrite_checkpoint
from tests.tiny_models import make_tiny_model, mixed_prompts

ARCHS = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")


@pytest.fixture(scope="module", params=ARCHS)
def moe(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def loaded(path, tp: TensorParallel | None = None, load_format: str = "auto"):
    config = load_model_config(path)
    config = config if tp is None else shard_config(config, tp.size)
    model = build_model(config, TorchAttentionBackend(), 64, tp)
    load_weights(model, path, load_format)
    return model


def test_every_expert_tensor_lands_in_its_stacked_slice(moe):
    model = loaded(moe)
    targets = checkpoint_targets(model)
    # Under the model's own names (Mixtral's checkpoint_tensors renames its experts).
    tensors = dict(model.checkpoint_tensors(load_file(moe / "model.safetensors").items()))
    assert tensors.keys() == targets.keys()
    for name, tensor in tensors.items():
        assert torch.equal(targets[name].view, tensor), name


def fuse_experts(tensors: dict[str, torch.Tensor]) -> None:
    """Qwen's per-expert tensors as transformers 5 holds them: gate_up_proj [E, 2I, H] and
    down_proj [E, H, I] of each layer."""
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        count = sum(1 for name in tensors if name.startswith(prefix) and name.endswith("down_proj.weight"))
        if not count:
            continue
        gate, up, down = ([tensors.pop(f"{prefix}.{e}.{p}.weight") for e in range(count)]
                          for p in ("gate_proj", "up_proj", "down_proj"))
        tensors[f"{prefix}.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], 1)
        tensors[f"{prefix}.down_proj"] = torch.stack(down)


@pytest.mark.parametrize("rank", [None, 1], ids=["whole", "rank_1_of_2"])
def test_fused_experts_of_transformers_5_load_as_per_expert_ones(tmp_path, rank):
    source = make_tiny_model("Qwen2MoeForCausalLM", tmp_path / "hf")
    (tmp_path / "fused").mkdir()
    rewrite_checkpoint(source, tmp_path / "fused", fuse_experts)
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(tmp_path / "fused" / "model.safetensors")
    tp = None if rank is None else TensorParallel(rank, 2)
    expected, fused = loaded(source, tp).state_dict(), loaded(tmp_path / "fused", tp).state_dict()
    assert fused.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(fused[name], tensor), name


def test_dummy_weights_give_finite_logits(moe):
    logits = paged_prefill_logits(moe, mixed_prompts(0)[:2], load_format="dummy")
    assert all(torch.isfinite(l).all() for l in logits)
    assert logits[0].std() > 0
