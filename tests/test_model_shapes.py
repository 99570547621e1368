import json

import pytest

from pagedserve.common.tokenizer import Tokenizer
from pagedserve.common.model_shapes import SHAPES, write_shape
from pagedserve.executor_svc.layers.moe import moe_shape
from pagedserve.executor_svc.model_config import load_model_config, model_config_from_dict, resolve_max_model_len
from pagedserve.executor_svc.layers.attention import layer_windows
from pagedserve.executor_svc.models.moe import sparse_layer


def test_shape_directory_with_a_tokenizer_decodes_every_id(tmp_path):
    path = write_shape("llama-3.1-8b", tmp_path / "m", tokenizer=True)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config == SHAPES["llama-3.1-8b"]
    tokenizer = Tokenizer.from_dir(path)
    vocab = config["vocab_size"]
    assert tokenizer.vocab_size == vocab
    assert tokenizer.decode([0, 17, vocab - 1]) == f"w0 w17 w{vocab - 1}"


def test_shape_directory_without_a_tokenizer(tmp_path):
    write_shape("llama-3.1-8b", tmp_path, tokenizer=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_qwen3_30b_a3b_builds_its_experts(tmp_path):
    config = load_model_config(write_shape("qwen3-30b-a3b", tmp_path))
    assert (config.architecture, config.num_hidden_layers) == ("Qwen3MoeForCausalLM", 48)
    assert moe_shape(config, None) == moe_shape(config, None, renormalize=True)
    shape = moe_shape(config, None)
    assert (shape.num_experts, shape.top_k, shape.intermediate_size) == (128, 8, 768)
    assert shape.shared_intermediate_size == 0
    assert all(sparse_layer(config.hf_config, i) for i in range(48))


def test_phi_3_mini_shape_is_its_config_json():
    config = model_config_from_dict(SHAPES["phi-3-mini"])
    assert (config.architecture, config.head_dim, config.num_key_value_heads) == ("Phi3ForCausalLM", 96, 32)
    assert (config.rope.scaling, config.rope.rotary_dim, resolve_max_model_len(config, None)) == (None, 96, 4096)
    assert layer_windows(config) == [2047] * 32


@pytest.mark.parametrize("name", SHAPES)
def test_every_shape_is_a_config_pagedserve_runs(name):
    config = model_config_from_dict(SHAPES[name])
    assert config.architecture == SHAPES[name]["architectures"][0]
    assert config.vocab_size == SHAPES[name]["vocab_size"]
