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
from pagedserve.executor_svc.parallel import TensorParallel, shard_config
from pagedserve.executor_svc.weight_loader import checkpoint_files, checkpoint_targets, load_weights
from tests.tiny_gguf import Q, write_gguf
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return make_tiny_model("Phi3ForCausalLM", tmp_path_factory.mktemp("phi3"))


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


# Phi-3's fused tensors: 4 query heads, then 2 key and 2 value heads, of 16 rows each; gate, then up.
FUSED = {"self_attn.qkv_proj": (64, 32, 32), "mlp.gate_up_proj": (128, 128)}


@pytest.mark.parametrize("source", ["safetensors", "gguf-f32", "gguf-q8_0"])
def test_a_rank_of_a_fused_tensor_holds_its_rows_of_each_shard(phi3, tmp_path, source):
    """-tp 2's rank r holds, of a fused qkv_proj, its half of the query rows, its half of the key
    rows and its half of the value rows: three slices, not one run of rows."""
    qtype = Q.Q8_0 if source.endswith("q8_0") else Q.F32
    path = phi3 if source == "safetensors" else write_gguf(phi3, tmp_path / "phi3.gguf", qtype)
    whole = dict(loaded(path).named_parameters())
    checkpoint = load_file(phi3 / "model.safetensors")
    for rank in (0, 1):
        config = shard_config(load_model_config(path), 2)
        model = build_model(config, TorchAttentionBackend(), 64, TensorParallel(rank, 2))
        load_weights(model, path, "auto")
        held = dict(model.named_parameters())
        for module, sizes in FUSED.items():
            name = f"model.layers.1.{module}.weight"
            expected = torch.cat([shard.chunk(2)[rank] for shard in whole[name].split(sizes)])
            assert torch.equal(held[name], expected), (rank, name)
            assert not torch.equal(held[name], whole[name].chunk(2)[rank]), (rank, name)
            if source == "safetensors":
                assert torch.equal(whole[name], checkpoint[name]), name


def test_a_fused_tensor_of_the_wrong_size_is_named(phi3, tmp_path):
    name = "model.layers.1.self_attn.qkv_proj.weight"
    rewrite_checkpoint(phi3, tmp_path, lambda t: t.update({name: t[name][:-16]}))
    with pytest.raises(ValueError, match=rf"checkpoint tensor {name} has shape \(112, 64\) but the "
                                         r"model expects 128 rows \(64 \+ 32 \+ 32\)"):
        loaded(tmp_path)


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
