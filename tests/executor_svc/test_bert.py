"""The encoders against transformers: last hidden states of a packed batch of mixed lengths
(with token types, as BERT pairs have them) and classifier logits, within 1e-4 in fp32; loading
with and without the encoder's prefix, skipping the heads a model does not run."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve.executor_svc.model_config import load_model_config
from pagedserve.executor_svc.models import ENCODERS, build_model
from pagedserve.executor_svc.parallel import TensorParallel
from pagedserve.executor_svc.weight_loader import load_weights
from tests.tiny_encoders import ENCODER_ARCHITECTURES, make_sentence_transformer, make_tiny_encoder, random_inputs

LENS = [5, 31, 1, 17, 64, 9]
TOL = 1e-4
# A multi-label classifier beside the one-label rerankers.
CONFIG_OVERRIDES = {"BertForSequenceClassification": dict(num_labels=3)}


@pytest.fixture(scope="module", params=ENCODER_ARCHITECTURES)
def encoder_dir(request, tmp_path_factory):
    arch = request.param
    return make_tiny_encoder(arch, tmp_path_factory.mktemp(arch), **CONFIG_OVERRIDES.get(arch, {}))


def load_ours(path, load_format="auto"):
    config = load_model_config(path)
    with torch.device("cpu"):
        model = build_model(config, None, config.max_position_embeddings)
    load_weights(model, path, load_format)
    return model.eval()


def packed_batch(arch, lens=LENS, seed=0):
    """Random inputs of `lens`, as lists per sequence and packed: BERT's as pairs (token types
    0 then 1), XLM-R's of one type."""
    xlm = arch.startswith("XLMRoberta")
    ids, types = random_inputs(lens, seed, cls_id=0 if xlm else 2, type_ids=not xlm)
    flat = dict(input_ids=torch.tensor(sum(ids, [])), token_type_ids=torch.tensor(sum(types, [])),
                positions=torch.cat([torch.arange(n) for n in lens]), seq_lens=lens)
    return ids, types, flat


def transformers_outputs(path, arch, ids, types):
    """Each sequence's last hidden state (and a classifier's logits), run one at a time."""
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    hidden, logits = [], []
    with torch.no_grad():
        for seq, seq_types in zip(ids, types):
            out = model(torch.tensor([seq]), token_type_ids=torch.tensor([seq_types]), output_hidden_states=True)
            hidden.append(out.hidden_states[-1][0])
            logits.append(out.logits[0] if hasattr(out, "logits") else None)
    return hidden, logits


def test_hidden_states_and_logits_equal_transformers(encoder_dir):
    arch = json.loads((encoder_dir / "config.json").read_text())["architectures"][0]
    ids, types, batch = packed_batch(arch)
    model = load_ours(encoder_dir)
    with torch.no_grad():
        hidden = model(**batch)
    expected_hidden, expected_logits = transformers_outputs(encoder_dir, arch, ids, types)
    torch.testing.assert_close(hidden, torch.cat(expected_hidden), atol=TOL, rtol=0)
    if arch.endswith("ForSequenceClassification"):
        starts = torch.tensor([0, *LENS[:-1]]).cumsum(0)
        with torch.no_grad():
            logits = model.classify(hidden[starts])
        torch.testing.assert_close(logits, torch.stack(expected_logits), atol=TOL, rtol=0)


def test_a_sequence_sees_only_its_own_tokens(encoder_dir):
    """A sequence's hidden states are the same alone and packed between others."""
    arch = json.loads((encoder_dir / "config.json").read_text())["architectures"][0]
    ids, types, batch = packed_batch(arch)
    n = LENS[1]
    alone = dict(input_ids=torch.tensor(ids[1]), token_type_ids=torch.tensor(types[1]), positions=torch.arange(n),
                 seq_lens=[n])
    model = load_ours(encoder_dir)
    with torch.no_grad():
        packed, single = model(**batch), model(**alone)
    torch.testing.assert_close(packed[LENS[0]:LENS[0] + n], single, atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["BertModel", "XLMRobertaModel"])
def test_masked_lm_checkpoint_loads_as_the_encoder(arch, tmp_path):
    """A *ForMaskedLM checkpoint (encoder under `bert.`/`roberta.`, with the MLM head) loads as
    the bare encoder, its head skipped."""
    make_tiny_encoder(arch, tmp_path)
    masked_lm = arch.replace("Model", "ForMaskedLM")
    config = getattr(transformers, arch.replace("Model", "Config")).from_pretrained(tmp_path)
    torch.manual_seed(1)
    getattr(transformers, masked_lm)(config).save_pretrained(tmp_path / "mlm")
    names = load_file(tmp_path / "mlm" / "model.safetensors").keys()
    assert any(n.startswith(("bert.", "roberta.")) for n in names) and any(n.startswith(("cls.", "lm_head.")) for n in names)
    config_json = json.loads((tmp_path / "mlm" / "config.json").read_text())
    (tmp_path / "mlm" / "config.json").write_text(json.dumps({**config_json, "architectures": [arch]}))
    ids, types, batch = packed_batch(arch)
    with torch.no_grad():
        hidden = load_ours(tmp_path / "mlm")(**batch)
    expected, _ = transformers_outputs(tmp_path / "mlm", masked_lm, ids, types)
    torch.testing.assert_close(hidden, torch.cat(expected), atol=TOL, rtol=0)


def test_sentence_transformers_dir_loads_and_mean_pools_to_its_encode(tmp_path):
    """The weights sentence-transformers saves at its directory's root load; mean-pooled and
    normalised they are what its encode returns."""
    from sentence_transformers import SentenceTransformer
    path = make_sentence_transformer(tmp_path / "st", "mean", normalize=True, arch="XLMRobertaModel")
    texts = ["what is the capital of france", "paris", "the river of the city berlin and its capital"]
    expected = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = [tokenizer(t)["input_ids"] for t in texts]
    lens = [len(i) for i in ids]
    with torch.no_grad():
        hidden = load_ours(path)(torch.tensor(sum(ids, [])), torch.cat([torch.arange(n) for n in lens]),
                                 torch.zeros(sum(lens), dtype=torch.long), lens)
    pooled = torch.stack([h.mean(0) for h in hidden.split(lens)])
    torch.testing.assert_close(torch.nn.functional.normalize(pooled, dim=-1), expected, atol=TOL, rtol=0)


def test_dummy_weights_fill_every_parameter(encoder_dir):
    model = load_ours(encoder_dir, "dummy")
    assert torch.equal(model.embeddings.LayerNorm.weight, torch.ones_like(model.embeddings.LayerNorm.weight))
    assert model.encoder.layer[0].attention.qkv_proj.weight.std() > 0.01


def test_missing_encoder_tensor_is_named(tmp_path):
    path = make_tiny_encoder("BertModel", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["encoder.layer.1.attention.self.key.bias"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensors \(encoder\.layer\.1\.attention\.self\.key\.bias\)"):
        load_ours(path)


def test_encoders_refuse_tensor_parallelism(encoder_dir):
    config = load_model_config(encoder_dir)
    with pytest.raises(ValueError, match=r"is an encoder, which pagedserve runs on one GPU; drop --tensor-parallel"):
        build_model(config, None, 0, TensorParallel(rank=0, size=2))


def test_relative_position_embeddings_are_refused(tmp_path):
    path = make_tiny_encoder("BertModel", tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key' is not supported"):
        load_model_config(path)


def test_xlm_roberta_serves_its_positions_past_the_padding_id(tmp_path):
    """514 position rows hold 512 positions: max_position_embeddings counts those."""
    path = make_tiny_encoder("XLMRobertaModel", tmp_path)
    config = load_model_config(path)
    assert config.max_position_embeddings == 128
    assert ENCODERS["XLMRobertaModel"](config).embeddings.position_embeddings.num_embeddings == 130


@pytest.mark.parametrize("arch", ["BertModel", "XLMRobertaModel"])
def test_tiny_tokenizers_encode_alike_in_transformers_and_pagedserve(arch, tmp_path):
    from pagedserve.common.tokenizer import Tokenizer
    path = make_tiny_encoder(arch, tmp_path)
    ours, theirs = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    for text in ["What is the capital of France?", "paris, the city on the river", "x"]:
        assert ours.encode(text) == theirs(text)["input_ids"]
