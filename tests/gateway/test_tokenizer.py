import json
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as RustTokenizer

from pagedserve.common.tokenizer import ChatTemplateError, Tokenizer

CHAT = [{"role": "user", "content": "hi"}]


def test_emoji_spans_several_tokens(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    assert tokenizer.decode(ids) == "😀"


def test_special_tokens_from_strings_and_added_token_dicts(tokenizer):
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id
    assert tokenizer.decode([tokenizer.bos_token_id, *tokenizer.encode("hi", False)]) == "hi"
    assert "<s>" in tokenizer.decode(tokenizer.encode("hi"), skip_special_tokens=False)


def test_chat_prompt_has_one_bos(tokenizer):
    text = tokenizer.apply_chat_template(CHAT)
    assert text == "<s><|user|>hi\n<|assistant|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def _copy(tokenizer_dir, tmp_path, **config_changes):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    return tmp_path


def test_template_features_match_transformers(tokenizer_dir, tmp_path):
    template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
                "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}\n"
                "  {% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
                "{% endfor %}")
    tok = Tokenizer.from_dir(_copy(tokenizer_dir, tmp_path, chat_template=template))
    assert tok.apply_chat_template([{"role": "user", "content": "ü"}, CHAT[0]]) == (
        '[{"role": "user", "content": "ü"}, {"role": "user", "content": "hi"}]|4\nü')
    with pytest.raises(ChatTemplateError, match="no system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_chat_template_jinja_file_wins(tokenizer_dir, tmp_path):
    path = _copy(tokenizer_dir, tmp_path)
    (path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_dir(path).apply_chat_template(CHAT) == "[hi]"


def test_named_template_list(tokenizer_dir, tmp_path):
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert Tokenizer.from_dir(_copy(tokenizer_dir, tmp_path, chat_template=templates)) \
        .apply_chat_template(CHAT) == "D"


def test_missing_chat_template_is_a_clear_error(tokenizer_dir, tmp_path):
    tok = Tokenizer.from_dir(_copy(tokenizer_dir, tmp_path, chat_template=None))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(CHAT)


def test_add_bos_token_without_post_processor(tokenizer_dir, tmp_path):
    path = _copy(tokenizer_dir, tmp_path, add_bos_token=True)
    rust = RustTokenizer.from_file(str(path / "tokenizer.json"))
    rust.post_processor = None
    rust.save(str(path / "tokenizer.json"))
    tok = Tokenizer.from_dir(path)
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id


def test_gateway_does_not_import_torch():
    code = "import sys, pagedserve.gateway.server; sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_matches_transformers(tokenizer_dir, tokenizer):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 😀"}]
    text = tokenizer.apply_chat_template(chat)
    assert text == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(text, add_special_tokens=False) == \
        reference.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tokenizer.encode("Grüße 😀") == reference.encode("Grüße 😀")
    assert tokenizer.eos_token_id == reference.eos_token_id
