"""A reranker's (query, document) input, and the Tokenizer pieces it uses, against transformers'
tokenizers and chat templates: what vLLM feeds each kind of reranker."""
from pathlib import Path

import pytest
import transformers

from pagedserve.common.score_inputs import pair_input
from pagedserve.common.tokenizer import Tokenizer
from tests.gateway.fake_engine import build_tiny_tokenizer
from tests.tiny_encoders import save_tokenizer

QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "berlin", "the river of the city is a river of germany"]
# vLLM's score template for Qwen3-Reranker (examples/pooling/score/template/qwen3_reranker.jinja), shortened.
SCORE_TEMPLATE = ('<|im_start|>system\nJudge whether the Document meets the requirements.<|im_end|>\n'
                  '<|im_start|>user\n<Query>: {{ messages | selectattr("role", "eq", "query") | '
                  'map(attribute="content") | first }}\n<Document>: {{ messages | '
                  'selectattr("role", "eq", "document") | map(attribute="content") | first }}<|im_end|>\n'
                  '<|im_start|>assistant\n')


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def encoder_tokenizer(request, tmp_path_factory) -> tuple[Tokenizer, transformers.PreTrainedTokenizerBase]:
    path = tmp_path_factory.mktemp(request.param)
    save_tokenizer(path, xlm=request.param == "xlm-roberta")
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("decoder")
    build_tiny_tokenizer(path)
    return path


def test_a_cross_encoder_pair_is_the_tokenizer_pair_with_its_token_types(encoder_tokenizer):
    ours, theirs = encoder_tokenizer
    assert ours.separates_pairs
    for document in DOCUMENTS:
        expected = theirs(QUERY, document)
        ids, types = pair_input(ours, QUERY, document)
        assert ids == expected["input_ids"]
        # XLM-R's pair has no second token type: empty stands for all zeros.
        assert (types or [0] * len(ids)) == expected.get("token_type_ids", [0] * len(ids))


def test_encode_tail_keeps_the_last_tokens_and_the_special_ones(encoder_tokenizer):
    ours, theirs = encoder_tokenizer
    theirs.truncation_side = "left"
    text = DOCUMENTS[2]
    for keep in (3, 6, 100):
        assert ours.encode_tail(text, keep) == theirs(text, truncation=True, max_length=keep)["input_ids"]


def test_a_decoder_without_a_score_template_joins_the_texts(decoder_dir):
    tokenizer = Tokenizer.from_dir(decoder_dir)
    assert not tokenizer.separates_pairs and not tokenizer.has_score_template
    assert pair_input(tokenizer, QUERY, DOCUMENTS[0]) == (tokenizer.encode(QUERY + DOCUMENTS[0]), [])


def test_a_score_template_formats_the_pair_as_transformers_renders_it(decoder_dir):
    tokenizer = Tokenizer.from_dir(decoder_dir, chat_template=SCORE_TEMPLATE)
    assert tokenizer.has_score_template
    messages = [{"role": "query", "content": QUERY}, {"role": "document", "content": DOCUMENTS[0]}]
    theirs = transformers.AutoTokenizer.from_pretrained(decoder_dir)
    text = theirs.apply_chat_template(messages, chat_template=SCORE_TEMPLATE, tokenize=False)
    assert pair_input(tokenizer, QUERY, DOCUMENTS[0]) == (theirs(text, add_special_tokens=False)["input_ids"], [])


def test_a_chat_template_without_query_and_document_roles_is_no_score_template(decoder_dir):
    qwen3 = (Path(__file__).parent / "gateway" / "templates" / "qwen3.jinja").read_text()
    assert not Tokenizer.from_dir(decoder_dir, chat_template=qwen3).has_score_template
