"""The pooler config read from directories sentence-transformers itself saved, from the older
Pooling format Hub models hold, from config.json alone, and as --pooler-config overrides it."""
import json

import pytest
import torch

from pagedserve.executor_svc.pooler_config import PoolerConfig, label_names, load_pooler_config
from tests.tiny_encoders import PROMPTS, make_sentence_transformer, make_tiny_encoder


@pytest.fixture(scope="module")
def st_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("st")
    return {"mean": make_sentence_transformer(root / "mean", "mean", normalize=True, default_prompt_name="query"),
            "cls": make_sentence_transformer(root / "cls", "cls", normalize=False, arch="XLMRobertaModel"),
            "lasttoken": make_sentence_transformer(root / "lasttoken", "lasttoken", normalize=True)}


@pytest.mark.parametrize("name, expected", [
    ("mean", PoolerConfig("MEAN", normalize=True, default_prompt=PROMPTS["query"])),
    ("cls", PoolerConfig("CLS", normalize=False)),
    ("lasttoken", PoolerConfig("LAST", normalize=True)),
])
def test_sentence_transformers_dirs(st_dirs, name, expected):
    assert load_pooler_config(st_dirs[name]) == expected


def write_st_files(path, pooling: dict, modules=("Transformer", "Pooling", "Normalize")):
    """modules.json and 1_Pooling/config.json as sentence-transformers before 6 wrote them."""
    dirs = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    entries = [{"idx": i, "name": str(i), "path": dirs[m], "type": f"sentence_transformers.models.{m}"}
               for i, m in enumerate(modules)]
    (path / "modules.json").write_text(json.dumps(entries))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = dict.fromkeys(["pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                           "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_lasttoken"], False)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags, **pooling}))
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return make_tiny_encoder("BertModel", tmp_path_factory.mktemp("bert"))


@pytest.mark.parametrize("flag, pooling_type", [("pooling_mode_cls_token", "CLS"),
                                                ("pooling_mode_mean_tokens", "MEAN"),
                                                ("pooling_mode_lasttoken", "LAST")])
def test_the_older_pooling_format(bert_dir, tmp_path, flag, pooling_type):
    path = write_st_files(tmp_path, {flag: True})
    (path / "config.json").write_bytes((bert_dir / "config.json").read_bytes())
    assert load_pooler_config(path) == PoolerConfig(pooling_type, normalize=True)


def test_without_sentence_transformers_files_vllm_defaults(bert_dir, tmp_path):
    assert load_pooler_config(bert_dir) == PoolerConfig("CLS", normalize=True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert load_pooler_config(tmp_path) == PoolerConfig("LAST", normalize=True)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert load_pooler_config(gguf) == PoolerConfig("LAST", normalize=True)


@pytest.mark.parametrize("arch, labels", [("BertForSequenceClassification", 1),
                                          ("XLMRobertaForSequenceClassification", 3)])
def test_classifiers_pool_their_first_token(tmp_path, arch, labels):
    path = make_tiny_encoder(arch, tmp_path, num_labels=labels)
    # transformers names unnamed labels LABEL_0, LABEL_1, ... in the config.json it saves.
    assert load_pooler_config(path) == PoolerConfig("CLS", normalize=False, num_labels=labels, activation=True,
                                                    labels=[f"LABEL_{i}" for i in range(labels)])


def test_label_names_come_from_id2label_when_it_names_every_output(tmp_path):
    names = {"0": "negative", "1": "neutral", "2": "positive"}
    path = make_tiny_encoder("BertForSequenceClassification", tmp_path, num_labels=3, id2label=names)
    assert load_pooler_config(path).labels == ["negative", "neutral", "positive"]
    assert label_names({"id2label": {"0": "a"}}, 2) == [] and label_names({}, 0) == []


def test_cross_encoder_saved_with_identity_activation_returns_raw_scores(tmp_path):
    from sentence_transformers import CrossEncoder
    path = make_tiny_encoder("BertForSequenceClassification", tmp_path / "hf")
    CrossEncoder(str(path), activation_fn=torch.nn.Identity(), device="cpu").save(str(tmp_path / "ce"))
    assert load_pooler_config(tmp_path / "ce").activation is False
    assert load_pooler_config(path).activation is True
    legacy = json.loads((path / "config.json").read_text())
    legacy["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (path / "config.json").write_text(json.dumps(legacy))
    assert load_pooler_config(path).activation is False


def test_yes_no_token_reranker_has_one_label(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                 "is_original_qwen3_reranker": True}
    assert load_pooler_config(tmp_path, hf_overrides=overrides) == PoolerConfig("LAST", normalize=False,
                                                                                 num_labels=1)


def test_matryoshka_dimensions(bert_dir, tmp_path):
    config = json.loads((bert_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [64, 32, 16]}))
    pooler = load_pooler_config(tmp_path, {"dimensions": 32})
    assert (pooler.matryoshka_dimensions, pooler.is_matryoshka, pooler.dimensions) == ([64, 32, 16], True, 32)
    with pytest.raises(ValueError, match=r"dimensions 24 is not one of the model's matryoshka_dimensions \[64, 32, 16\]"):
        load_pooler_config(tmp_path, {"dimensions": 24})
    (tmp_path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    assert load_pooler_config(tmp_path, {"dimensions": 24}).dimensions == 24
    with pytest.raises(ValueError, match="dimensions needs a Matryoshka model"):
        load_pooler_config(bert_dir, {"dimensions": 32})


def test_pooler_config_overrides(st_dirs):
    overrides = {"pooling_type": "cls", "normalize": False, "use_activation": False}
    assert load_pooler_config(st_dirs["mean"], overrides) == PoolerConfig(
        "CLS", normalize=False, default_prompt=PROMPTS["query"], activation=False)
    with pytest.raises(ValueError, match=r"--pooler-config has unknown keys \['softmax'\]"):
        load_pooler_config(st_dirs["mean"], {"softmax": True})
    with pytest.raises(ValueError, match="pooling_type 'MAX' is not supported; use one of CLS, MEAN, LAST"):
        load_pooler_config(st_dirs["mean"], {"pooling_type": "MAX"})


def test_a_pooling_pagedserve_does_not_compute_is_refused_unless_overridden(bert_dir, tmp_path):
    path = write_st_files(tmp_path, {"pooling_mode_max_tokens": True})
    (path / "config.json").write_bytes((bert_dir / "config.json").read_bytes())
    with pytest.raises(ValueError, match=r"1_Pooling/config.json asks for pooling max; pagedserve pools one of "
                                         r"cls, mean, lasttoken"):
        load_pooler_config(path)
    assert load_pooler_config(path, {"pooling_type": "MEAN"}).pooling_type == "MEAN"


def test_a_dense_module_is_refused(bert_dir, tmp_path):
    path = write_st_files(tmp_path, {"pooling_mode_mean_tokens": True}, ("Transformer", "Pooling", "Dense"))
    with pytest.raises(ValueError, match="modules.json has Dense modules, which pagedserve does not run"):
        load_pooler_config(path)
