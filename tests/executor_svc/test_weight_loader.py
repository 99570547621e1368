import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.model_config import load_model_config
from pagedserve.executor_svc.layers.decoder import CausalLM
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.weight_loader import checkpoint_files, checkpoint_targets, load_weights
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


def loaded(path, load_format: str = "auto", seed: int = 0) -> CausalLM:
    model = build_model(load_model_config(path), TorchAttentionBackend(), 64)
    load_weights(model, path, load_format, seed)
    return model


def rewrite_checkpoint(source, target, edit) -> None:
    shutil.copy(source / "config.json", target / "config.json")
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})


def test_every_checkpoint_tensor_lands_in_its_fused_slice(llama):
    model = loaded(llama)
    targets = checkpoint_targets(model)
    tensors = load_file(llama / "model.safetensors")
    assert tensors.keys() == targets.keys()
    for name, tensor in tensors.items():
        assert torch.equal(targets[name].view, tensor), name


def test_sharded_checkpoint_loads_like_a_single_file(llama, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    single, sharded = loaded(llama).state_dict(), loaded(tmp_path).state_dict()
    assert single.keys() == sharded.keys()
    for name in single:
        assert torch.equal(single[name], sharded[name]), name


def test_missing_tensor_is_named(llama, tmp_path):
    rewrite_checkpoint(llama, tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensors \(model.layers.1.self_attn.k_proj.weight\)"):
        loaded(tmp_path)


def test_unexpected_tensor_is_named(llama, tmp_path):
    rewrite_checkpoint(llama, tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected 1 tensors \(model.extra.weight\)"):
        loaded(tmp_path)


def test_wrong_shape_is_named(llama, tmp_path):
    rewrite_checkpoint(llama, tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(32)}))
    with pytest.raises(ValueError, match=r"norm.weight has shape \(32,\) but the model expects \(64,\)"):
        loaded(tmp_path)


def test_tied_checkpoint_loads_without_lm_head(tmp_path):
    path = make_tiny_model("Qwen2ForCausalLM", tmp_path)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = loaded(path)
    hidden = torch.randn(3, 64)
    expected = hidden @ load_file(path / "model.safetensors")["model.embed_tokens.weight"].T
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_dummy_weights_need_only_config_json(llama, tmp_path):
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="--load-format dummy"):
        loaded(tmp_path)
    first, again, other = loaded(tmp_path, "dummy"), loaded(tmp_path, "dummy"), loaded(tmp_path, "dummy", 1)
    weight = first.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(weight, again.model.layers[0].self_attn.qkv_proj.weight)
    assert not torch.equal(weight, other.model.layers[0].self_attn.qkv_proj.weight)
    assert abs(weight.std().item() - 0.02) < 0.002
    assert torch.equal(first.model.norm.weight, torch.ones(64))


def test_unknown_load_format_is_refused(llama):
    with pytest.raises(ValueError, match="--load-format 'pt'"):
        loaded(llama, "pt")


def test_calibrated_kv_cache_scales_load_into_their_layers(llama, tmp_path):
    def add_scales(tensors):
        tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
        tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([0.25])
    rewrite_checkpoint(llama, tmp_path, add_scales)
    layers = loaded(tmp_path).model.layers
    assert layers[0].self_attn.k_scale.item() == 0.5 and layers[1].self_attn.v_scale.item() == 0.25
    assert layers[0].self_attn.v_scale.item() == layers[1].self_attn.k_scale.item() == 1.0


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/hostname", "a/../../b.safetensors", "", 7])
def test_an_index_naming_a_shard_outside_the_model_folder_is_refused(tmp_path, shard):
    (tmp_path / "model").mkdir()
    index = tmp_path / "model" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-1.safetensors", "norm.weight": shard}}))
    with pytest.raises(ValueError, match="weight_map names the shard"):
        checkpoint_files(tmp_path / "model")
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "sub/model-1.safetensors"}}))
    assert checkpoint_files(tmp_path / "model") == [tmp_path / "model" / "sub" / "model-1.safetensors"]
