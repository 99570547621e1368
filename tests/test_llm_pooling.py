"""LLM.embed, .classify and .score against sentence-transformers and transformers on tiny random
models (float32, CPU, batches of mixed lengths): encoders with every pooling, normalisation on
and off, Matryoshka dimensions; decoders pooled through the paged prefill; cross-encoders and a
Qwen3-Reranker-style yes/no reranker; every KV block free afterwards."""
import json

import numpy as np
import pytest
import torch
import transformers
from sentence_transformers import CrossEncoder, SentenceTransformer
from tokenizers import Tokenizer, models, pre_tokenizers

from pagedserve import LLM
from pagedserve.common.pooling_params import PoolingParams
from tests.real_model import RAW_PROMPTS, smollm2_path, smollm2_transformers_model
from tests.tiny_encoders import make_sentence_transformer, make_tiny_encoder, random_inputs
from tests.tiny_models import make_tiny_model, mixed_prompts

TEXTS = ["what is the capital of france", "paris", "the river in the city of berlin is a river of germany",
         "a query", "passage to the capital and the city of paris is in france"]
TOL = 1e-4
LENS = [5, 17, 2, 40, 11, 29]


def assert_close(got: list[list[float]], expected: np.ndarray) -> None:
    got = np.array(got)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)


def all_blocks_free(llm: LLM) -> bool:
    s = llm.scheduler
    return not s.has_work() and s.num_free_blocks == s.block_manager.num_usable_blocks


@pytest.mark.parametrize("pooling, normalize, arch", [("mean", True, "BertModel"), ("cls", False, "BertModel"),
                                                      ("lasttoken", True, "XLMRobertaModel")])
def test_embeddings_equal_sentence_transformers(tmp_path, pooling, normalize, arch):
    path = make_sentence_transformer(tmp_path / "st", pooling=pooling, normalize=normalize, arch=arch)
    expected = SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_numpy=True)
    llm = LLM(str(path), device="cpu")
    assert llm.pooling.tasks == ["embed"] and llm.worker.runner_kind == "pooling"
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert_close([o.outputs.embedding for o in outs], expected)
    assert outs[1].prompt_token_ids == llm.tokenizer.encode(TEXTS[1])
    # A request may turn the model's normalisation off (or on).
    raw = llm.embed(TEXTS, PoolingParams(normalize=not normalize), use_tqdm=False)
    vectors = np.array([o.outputs.embedding for o in raw])
    if normalize:
        np.testing.assert_allclose(vectors / np.linalg.norm(vectors, axis=1, keepdims=True), expected, atol=TOL)
    else:
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert all_blocks_free(llm)


def test_matryoshka_dimensions_truncate_then_normalise(tmp_path):
    path = make_sentence_transformer(tmp_path / "st", matryoshka_dimensions=[64, 32, 16])
    model = SentenceTransformer(str(path), device="cpu")
    llm = LLM(str(path), device="cpu")
    assert (llm.pooling.matryoshka_dimensions, llm.pooling.is_matryoshka) == ([64, 32, 16], True)
    expected = model.encode(TEXTS, convert_to_numpy=True, truncate_dim=16, normalize_embeddings=True)
    outs = llm.embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False)
    assert_close([o.outputs.embedding for o in outs], expected)
    with pytest.raises(ValueError, match=r"only supports \[64, 32, 16\]"):
        llm.embed(TEXTS, PoolingParams(dimensions=8), use_tqdm=False)
    assert all_blocks_free(llm)


def test_bi_encoder_score_is_the_cosine_of_the_embeddings(tmp_path):
    path = make_sentence_transformer(tmp_path / "st", normalize=False)
    model = SentenceTransformer(str(path), device="cpu")
    llm = LLM(str(path), device="cpu")
    scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    query, docs = model.encode(TEXTS[:1], convert_to_tensor=True), model.encode(TEXTS[1:], convert_to_tensor=True)
    expected = torch.nn.functional.cosine_similarity(query, docs).numpy()
    np.testing.assert_allclose(scores, expected, atol=TOL)


@pytest.mark.parametrize("arch", ["BertForSequenceClassification", "XLMRobertaForSequenceClassification"])
def test_cross_encoder_scores_equal_transformers_sigmoid_of_the_logit(tmp_path, arch):
    path = make_tiny_encoder(arch, tmp_path / "ce")
    llm = LLM(str(path), device="cpu")
    assert llm.pooling.tasks == ["classify"] and llm.pooling.num_labels == 1
    outs = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    expected = CrossEncoder(str(path), device="cpu").predict([(TEXTS[0], t) for t in TEXTS[1:]])
    np.testing.assert_allclose([o.outputs.score for o in outs], expected, atol=TOL)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = [model(**transformers.AutoTokenizer.from_pretrained(path)(t, return_tensors="pt")).logits[0]
                  for t in TEXTS]
    raw = llm.classify(TEXTS, PoolingParams(activation=False), use_tqdm=False)
    np.testing.assert_allclose([o.outputs.probs for o in raw], torch.stack(logits).numpy(), atol=TOL)
    assert all_blocks_free(llm)


def test_a_classifier_of_several_labels_returns_softmax_probabilities(tmp_path):
    path = make_tiny_encoder("BertForSequenceClassification", tmp_path / "cls", num_labels=3)
    ids, types = random_inputs(LENS, seed=1, cls_id=2, type_ids=True)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = [model(input_ids=torch.tensor([i]), token_type_ids=torch.tensor([t])).logits[0].softmax(-1)
                    for i, t in zip(ids, types)]
    llm = LLM(str(path), device="cpu")
    # Pairs' token types reach the encoder: through _pool, as score() sends them.
    got = llm._pool(list(zip(ids, types)), PoolingParams("classify"), use_tqdm=False)[2]
    np.testing.assert_allclose(got, torch.stack(expected).numpy(), atol=TOL)


def hf_hidden(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' final hidden states (after the final norm) of each prompt, alone."""
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


@pytest.mark.parametrize("arch, pooling_type", [("LlamaForCausalLM", "LAST"), ("Qwen3ForCausalLM", "MEAN")])
def test_decoder_embeddings_are_its_pooled_final_hidden_states(tmp_path, arch, pooling_type):
    path = make_tiny_model(arch, tmp_path / "m")
    prompts = mixed_prompts(seed=2)
    hidden = hf_hidden(path, prompts)
    pooled = torch.stack([h[-1] if pooling_type == "LAST" else h.mean(0) for h in hidden])
    # A small block size, so prompts span several blocks of the paged prefill.
    llm = LLM(str(path), device="cpu", runner="pooling", pooler_config={"pooling_type": pooling_type}, block_size=4)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    expected = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    assert_close([o.outputs.embedding for o in outs], expected)
    raw = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False), use_tqdm=False)
    assert_close([o.outputs.embedding for o in raw], pooled.numpy())
    assert all_blocks_free(llm)


def save_word_tokenizer(path, words: list[str]) -> None:
    """A whitespace word-level tokenizer.json (+ config) that transformers and pagedserve read alike."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "unk_token": "<unk>"}))


def test_qwen3_reranker_scores_are_the_yes_no_softmax(tmp_path):
    path = make_tiny_model("Qwen3ForCausalLM", tmp_path / "rr")
    words = ["<unk>", "no", "yes", *sorted({w for t in TEXTS for w in t.split()})]
    save_word_tokenizer(path, words)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                 "is_original_qwen3_reranker": True}
    llm = LLM(str(path), device="cpu", hf_overrides=overrides, block_size=4)
    assert llm.pooling.tasks == ["classify"] and llm.worker.runner_kind == "pooling"
    query = TEXTS[0] + " "
    outs = llm.score(query, TEXTS[1:], use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for doc in TEXTS[1:]:
            # Without a score template, a decoder's pair is the two texts joined (vLLM's).
            ids = [words.index(w) for w in (query + doc).split()]
            logits = model(torch.tensor([ids])).logits[0, -1]
            expected.append(logits[[1, 2]].softmax(-1)[1].item())
            assert outs[len(expected) - 1].prompt_token_ids == ids
    np.testing.assert_allclose([o.outputs.score for o in outs], expected, atol=TOL)
    assert all_blocks_free(llm)


def test_a_pooling_model_refuses_generation_and_a_generator_refuses_pooling(tmp_path):
    path = make_sentence_transformer(tmp_path / "st")
    with pytest.raises(ValueError, match="--runner pooling: it embeds"):
        LLM(str(path), device="cpu").generate(["paris"], use_tqdm=False)
    with pytest.raises(ValueError, match="is an encoder, which only pools"):
        LLM(str(path), device="cpu", runner="generate")
    decoder = LLM(str(make_tiny_model("LlamaForCausalLM", tmp_path / "m")), device="cpu")
    with pytest.raises(ValueError, match="start the engine with --runner pooling"):
        decoder.embed([{"prompt_token_ids": [5, 6]}], use_tqdm=False)
    assert all_blocks_free(decoder)


def test_smollm2_embeddings_are_its_normalised_last_hidden_states():
    path = smollm2_path()
    llm = LLM(str(path), device="cpu", runner="pooling", max_model_len=256, dtype="float32")
    assert llm.pooling.tasks == ["embed"] and llm.pooling.embedding_size == 576
    outs = llm.embed(list(RAW_PROMPTS), use_tqdm=False)
    model = smollm2_transformers_model()
    with torch.inference_mode():
        hidden = [model.model(torch.tensor([o.prompt_token_ids])).last_hidden_state[0, -1] for o in outs]
    expected = torch.nn.functional.normalize(torch.stack(hidden), dim=-1).numpy()
    assert_close([o.outputs.embedding for o in outs], expected)
    assert all_blocks_free(llm)


def test_task_and_flag_values_pick_the_runner_or_are_refused(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m")
    llm = LLM(str(path), device="cpu", task="embed")
    assert llm.worker.runner_kind == "pooling" and llm.pooling.tasks == ["embed"]
    with pytest.raises(ValueError, match="does not support the 'classify' task; it serves embed"):
        llm.classify([{"prompt_token_ids": [5, 6]}], use_tqdm=False)
    with pytest.raises(ValueError, match="pooler_config='MEAN': must be a JSON object"):
        LLM(str(path), device="cpu", pooler_config="MEAN")
    with pytest.raises(ValueError, match="runner='embed': choose from auto, generate, pooling"):
        LLM(str(path), device="cpu", runner="embed")
    seq_cls = {"architectures": ["LlamaForSequenceClassification"]}
    with pytest.raises(ValueError, match="unsupported architecture .'LlamaForSequenceClassification'."):
        LLM(str(path), device="cpu", hf_overrides=seq_cls)
    with pytest.raises(ValueError, match="has no classifier: a decoder classifies with"):
        LLM(str(path), device="cpu", hf_overrides={**seq_cls, "classifier_from_token": ["yes"]})


def test_a_token_type_past_the_encoders_table_fails_that_input_alone(tmp_path):
    llm = LLM(str(make_tiny_encoder("XLMRobertaForSequenceClassification", tmp_path / "ce")), device="cpu")
    ids, _ = random_inputs([4, 6], seed=3, cls_id=0)
    with pytest.raises(ValueError, match="token_type_ids must be below this model's type_vocab_size 1"):
        llm._pool([(ids[0], [0, 1, 0, 0]), (ids[1], [])], PoolingParams("classify"), use_tqdm=False)
    assert all_blocks_free(llm)
