import json

import pytest

from pagedserve.common.tokenizer import Tokenizer
from pagedserve.common.model_shapes import SHAPES, write_shape
from pagedserve.executor_svc.model_config import model_config_from_dict


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


@pytest.mark.parametrize("name", SHAPES)
def test_every_shape_is_a_config_pagedserve_runs(name):
    config = model_config_from_dict(SHAPES[name])
    assert config.architecture == SHAPES[name]["architectures"][0]
    assert config.vocab_size == SHAPES[name]["vocab_size"]
