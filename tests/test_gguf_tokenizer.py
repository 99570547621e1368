"""The tokenizer built from GGUF metadata against transformers' own GGUF tokenizer (the reference)."""
import json
from array import array
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, trainers

from pagedserve.common.detokenizer import IncrementalDetokenizer
from pagedserve.common.gguf_metadata import read_gguf_header, read_gguf_metadata
from pagedserve.common.gguf_tokenizer import load_gguf_tokenizer
from pagedserve.common.tokenizer import Tokenizer
from tests.real_model import smollm2_path, smollm2_transformers_tokenizer

gguf = pytest.importorskip("gguf", reason="gguf (a dev dependency) writes the small test GGUF files")
Q = gguf.GGMLQuantizationType
transformers = pytest.importorskip("transformers", reason="transformers is the reference tokenizer")


STRINGS = [
    # ASCII
    "Hello world", "The quick brown fox jumps over the lazy dog.", "HELLO hello HeLLo", "a", "",
    "I'm sure it's fine, they'll see; won't they? We've done it.", "!!!???...;;;", "snake_case camelCase kebab-case",
    # code
    "def add(a, b):\n    return a + b\n", "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "SELECT * FROM users WHERE id = 42;", '<div class="x">&amp;</div>', '{"key": [1, 2, 3], "nested": {"a": null}}',
    '#include <stdio.h>\nint main() { printf("%d\\n", 1); }', "x => x ** 2 // comment",
    # emoji
    "😀", "Party time 🎉🎊", "👨‍👩‍👧‍👦 family", "🇫🇷🇯🇵 flags", "❤️ with a variation selector", "👍🏽 skin tone",
    # CJK
    "日本語のテキスト", "中文分词测试：你好，世界！", "한국어 문장입니다.", "漢字かなカナ混じり文",
    # RTL
    "مرحبا بالعالم", "שלום עולם", "English then عربي then English", "123 مرحبا 456",
    # other scripts and combining marks
    "Grüße aus München, ça va très bien", "Ελληνικά κείμενα", "Привет, мир!", "नमस्ते दुनिया", "ภาษาไทย",
    "e\u0301 versus \u00e9", "zero\u200bwidth and \u200d joiner", "non\u00a0breaking", "\ufb01 ligature",
    "\U0001d400\U0001d401 math bold",
    # whitespace
    "   leading spaces", "trailing spaces   ", "multiple    inner     spaces", "\t\ttabs\tand\ttabs",
    "line1\nline2\r\nline3\rline4", "\n\n\nnewlines\n\n", " \t \n mixed \n\t ", "      ",
    # special-token text
    "<|im_start|>user\nHello<|im_end|>", "<|im_start|>assistant\n", "<|endoftext|>", "text<|im_end|>more",
    "<repo_name>x<file_sep>y", "<|im_start|> spaced <|im_end|>", "<|im_start", "<|im_start|><|im_end|>",
    # numbers
    "1234567890", "3.14159 2.71828 -42 +7 1e10", "2024-06-01T12:34:56Z", "$1,234.56 and 99%", "\uff10\uff11\uff12 fullwidth",
    # leading space
    " leading", " Hello", "  two leading", " 😀",
    # odd characters
    "\ufffd replacement character", "\x00 nul and \x7f del", "word " * 60,
]

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke 😀"}],
    [{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": "日本語で？"},
     {"role": "assistant", "content": "はい。"}, {"role": "user", "content": "مرحبا\n\n  code:\tx = 1"}],
    [{"role": "user", "content": "What does <|im_end|> mean?"}],
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_path()


@pytest.fixture(scope="module")
def ours(smollm2) -> Tokenizer:
    return Tokenizer.load(smollm2)


@pytest.fixture(scope="module")
def reference(smollm2):
    return smollm2_transformers_tokenizer()


def test_tokenizer_json_equals_transformers(smollm2, reference):
    built = load_gguf_tokenizer(smollm2).tokenizer
    assert json.loads(built.to_str()) == json.loads(reference.backend_tokenizer.to_str())


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_token_ids_equal_transformers(ours, reference, add_special_tokens):
    assert len(STRINGS) >= 40
    assert [ours.encode(s, add_special_tokens) for s in STRINGS] == \
        [reference.encode(s, add_special_tokens=add_special_tokens) for s in STRINGS]


def test_special_tokens_equal_transformers(ours, reference):
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (ours.bos_token_id, ours.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)
    assert ours.vocab_size == len(reference) == 49152


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers(ours, reference, skip_special_tokens):
    ids = [reference.encode(s, add_special_tokens=False) for s in STRINGS]
    ids.append([19556, 3, 1, 4093, 2, 0, 216])
    assert [ours.decode(i, skip_special_tokens) for i in ids] == \
        [reference.decode(i, skip_special_tokens=skip_special_tokens) for i in ids]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_round_trips_where_transformers_does(ours, reference, skip_special_tokens):
    theirs = [s for s in STRINGS if s == reference.decode(reference.encode(s, add_special_tokens=False),
                                                          skip_special_tokens=skip_special_tokens)]
    assert [s for s in STRINGS if ours.decode(ours.encode(s, False), skip_special_tokens) == s] == theirs
    # Byte-level BPE loses nothing; skipping special tokens drops only the special-token texts.
    lost = {s for s in STRINGS if s not in theirs}
    assert lost == (set() if not skip_special_tokens else {s for s in STRINGS if "|>" in s or "<repo_name>" in s})


@pytest.mark.parametrize("chat", CHATS, ids=[f"chat{i}" for i in range(len(CHATS))])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(ours, reference, chat, add_generation_prompt):
    text = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.encode(text, add_special_tokens=False) == reference.apply_chat_template(
        chat, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)


def test_default_system_prompt_only_without_a_system_message(ours):
    assert ours.apply_chat_template(CHATS[0]).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert ours.apply_chat_template(CHATS[1]).startswith("<|im_start|>system\nYou are terse.<|im_end|>")


def _stream_one_by_one(tokenizer, ids, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    chunks = [detok.add([i]) for i in ids]
    return chunks + [detok.flush()], detok


def test_incremental_detokenizer_equals_full_decode(ours):
    for s in STRINGS:
        ids = ours.encode(s, add_special_tokens=False)
        chunks, detok = _stream_one_by_one(ours, ids)
        assert "".join(chunks) == detok.text == ours.decode(ids), s
        if "\ufffd" not in s:
            assert not any("\ufffd" in chunk for chunk in chunks), s


def test_incremental_detokenizer_after_a_chat_prompt(ours):
    prompt = ours.encode(ours.apply_chat_template(CHATS[3]), add_special_tokens=False)
    reply = ours.encode("Bien sûr 😀 — 日本語 مرحبا", add_special_tokens=False) + [ours.eos_token_id]
    chunks, _ = _stream_one_by_one(ours, reply, prompt_token_ids=prompt)
    assert "".join(chunks) == "Bien sûr 😀 — 日本語 مرحبا"
    chunks, _ = _stream_one_by_one(ours, reply, prompt_token_ids=prompt, skip_special_tokens=False)
    assert "".join(chunks) == "Bien sûr 😀 — 日本語 مرحبا<|im_end|>"


def test_emoji_bytes_split_over_tokens(ours):
    ids = ours.encode("😀", add_special_tokens=False)
    assert len(ids) > 1 and ours.decode(ids[:-1]).endswith("\ufffd")
    chunks, _ = _stream_one_by_one(ours, ids)
    assert chunks[:-2] == [""] * (len(ids) - 1) and "".join(chunks) == "😀"


# Small GGUF files written here: a Llama-style sentencepiece vocabulary and a byte-level one.
_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! Grüße aus München, ça va.",
           "日本語のテキスト", "def f(x):\n    return x + 1", "Party 🎉 time 😀", "  spaced\tout\n"] * 10
_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def _write(path: Path, architecture: str, model: str, tokens: list[str], types: list[int],
           **fields) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for name, value in fields.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def _trained(pre_tokenizer, **trainer_args) -> dict:
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.train_from_iterator(_CORPUS, trainers.BpeTrainer(show_progress=False, **trainer_args))
    return json.loads(tokenizer.to_str())["model"]


def _write_sentencepiece(path: Path, **fields) -> Path:
    """Llama's layout: <unk> <s> </s>, 256 byte tokens, then pieces scored best-first, no merges."""
    vocab = _trained(pre_tokenizers.Metaspace(), vocab_size=300)["vocab"]
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return _write(path, "llama", "llama", tokens, types, token_scores=scores, bos_token_id=1, eos_token_id=2,
                  unk_token_id=0, tokenizer_pre="default", chat_template=_TEMPLATE, **fields)


def _write_byte_level(path: Path, pre: str) -> Path:
    """Qwen2's layout, with a user-defined <think> and a control token llama.cpp mislabels."""
    model = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), vocab_size=400,
                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    pieces = sorted(model["vocab"], key=model["vocab"].get)
    tokens = ["<|begin|>", "<|end|>", *pieces, "<think>", "<|fim prefix|>"]
    types = [3, 3, *[1] * len(pieces), 4, 3]
    merges = [" ".join(merge) for merge in model["merges"]]
    return _write(path, "qwen2", "gpt2", tokens, types, token_merges=merges, tokenizer_pre=pre, bos_token_id=0,
                  eos_token_id=1, add_bos_token=True, add_eos_token=True)


def _reference(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _assert_same_as_reference(path: Path, strings: list[str] = STRINGS) -> Tokenizer:
    ours, reference = Tokenizer.from_gguf(path), _reference(path)
    for add_special_tokens in (True, False):
        assert [ours.encode(s, add_special_tokens) for s in strings] == \
            [reference.encode(s, add_special_tokens=add_special_tokens) for s in strings]
    ids = [reference.encode(s) for s in strings]
    for skip in (True, False):
        assert [ours.decode(i, skip) for i in ids] == [reference.decode(i, skip_special_tokens=skip) for i in ids]
    return ours


@pytest.mark.parametrize("flags", [{}, {"add_bos_token": False, "add_eos_token": True}])
def test_sentencepiece_equals_transformers(tmp_path, flags):
    path = _write_sentencepiece(tmp_path / "sp.gguf", **flags)
    assert json.loads(load_gguf_tokenizer(path).tokenizer.to_str()) == \
        json.loads(_reference(path).backend_tokenizer.to_str())
    ours = _assert_same_as_reference(path)
    ids = ours.encode("Hello 😀")
    assert (ids[0] == ours.bos_token_id) == flags.get("add_bos_token", True)
    assert (ids[-1] == ours.eos_token_id) == flags.get("add_eos_token", False)
    assert ours.encode("🦀", False)[-4:] == [3 + b for b in "🦀".encode()]
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-4o", "gpt-2"])
def test_byte_level_equals_transformers(tmp_path, pre):
    path = _write_byte_level(tmp_path / "bl.gguf", pre)
    # See test_byte_level_vocabulary_is_the_files.
    ours = _assert_same_as_reference(path, [s for s in STRINGS if "<|endoftext|>" not in s])
    think = read_gguf_metadata(path)["tokenizer.ggml.tokens"].index("<think>")
    assert think in ours.encode("x<think>y", add_special_tokens=False)
    assert ours.decode(ours.encode("a<think>b")) == "a<think>b"
    assert ours.encode("hi")[0] == 0 and ours.encode("hi")[-1] == 1


def test_byte_level_vocabulary_is_the_files(tmp_path):
    # transformers appends a "<|endoftext|>" the file lacks, an id past the model's embedding table.
    path = _write_byte_level(tmp_path / "bl.gguf", "qwen2")
    size = len(read_gguf_metadata(path)["tokenizer.ggml.tokens"])
    assert Tokenizer.from_gguf(path).vocab_size == size
    assert load_gguf_tokenizer(path).tokenizer.token_to_id("<|endoftext|>") is None
    assert _reference(path).convert_tokens_to_ids("<|endoftext|>") == size


def test_unsupported_tokenizer_model_is_named(tmp_path):
    path = _write(tmp_path / "t5.gguf", "t5", "t5", ["<pad>", "</s>"], [3, 3], token_scores=[0.0, 0.0])
    with pytest.raises(ValueError, match="'t5' tokenizer"):
        Tokenizer.from_gguf(path)


def test_file_without_tokenizer_is_a_clear_error(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        Tokenizer.from_gguf(tmp_path / "bare.gguf")


def _write_tensors(path: Path) -> Path:
    """Tensors of float and quantized types, 2-D and 1-D, after a header that is no multiple of 64."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_string("general.name", "x" * 5)
    rows = np.linspace(-1, 1, 6 * 64, dtype=np.float32).reshape(6, 64)
    writer.add_tensor("a.weight", rows)
    writer.add_tensor("b.weight", rows.astype(np.float16))
    for qtype in (Q.Q8_0, Q.Q4_1):
        writer.add_tensor(f"{qtype.name}.weight", gguf.quants.quantize(rows, qtype), raw_dtype=qtype)
    writer.add_tensor("norm.weight", np.ones(7, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_reader_header(path: Path) -> tuple[dict, list[tuple]]:
    reader = gguf.GGUFReader(str(path))
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = [(t.name, tuple(int(n) for n in reversed(t.shape)), t.tensor_type, t.data_offset, t.n_bytes)
               for t in reader.tensors]
    return metadata, tensors


def _assert_header_equals_gguf_reader(path: Path) -> dict:
    expected_metadata, expected_tensors = _gguf_reader_header(path)
    header = read_gguf_header(path)
    # Numeric arrays come packed (array.array), gguf's as lists.
    ours = {key: value.tolist() if isinstance(value, array) else value for key, value in header.metadata.items()}
    assert read_gguf_metadata(path) == header.metadata and ours == expected_metadata
    assert [(t.name, t.shape, t.ggml_type, t.offset, t.n_bytes) for t in header.tensors] == expected_tensors
    return expected_metadata


def test_metadata_equals_gguf_reader(tmp_path):
    expected = _assert_header_equals_gguf_reader(_write_sentencepiece(tmp_path / "sp.gguf", add_bos_token=False))
    assert expected["tokenizer.ggml.add_bos_token"] is False and len(expected["tokenizer.ggml.scores"]) > 300


def test_tensor_infos_equal_gguf_reader(tmp_path):
    path = _write_tensors(tmp_path / "tensors.gguf")
    _assert_header_equals_gguf_reader(path)
    tensors = read_gguf_header(path).tensors
    assert [t.shape for t in tensors] == [(6, 64)] * 4 + [(7,)]
    assert all(t.offset % 64 == 0 for t in tensors)


def test_smollm2_header_equals_gguf_reader(smollm2):
    _assert_header_equals_gguf_reader(smollm2)
    assert {t.ggml_type for t in read_gguf_header(smollm2).tensors} == {Q.F32, Q.Q8_0, Q.Q4_1}


def test_metadata_errors(tmp_path):
    (tmp_path / "not.gguf").write_bytes(b"{}")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(tmp_path / "not.gguf")
    data = _write_sentencepiece(tmp_path / "sp.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_metadata(tmp_path / "cut.gguf")
    (tmp_path / "v1.gguf").write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 1"):
        read_gguf_metadata(tmp_path / "v1.gguf")


def test_header_errors(tmp_path):
    path = _write_tensors(tmp_path / "tensors.gguf")
    data, tensors = path.read_bytes(), read_gguf_header(path).tensors
    (tmp_path / "short.gguf").write_bytes(data[:tensors[-1].offset + 1])
    with pytest.raises(ValueError, match="short.gguf is truncated: tensor norm.weight runs past the end"):
        read_gguf_header(tmp_path / "short.gguf")
    assert read_gguf_metadata(tmp_path / "short.gguf") == read_gguf_metadata(path)
    # Inside the tensor infos: under 64 bytes of padding separate them from the first tensor.
    (tmp_path / "cut.gguf").write_bytes(data[:tensors[0].offset - 70])
    with pytest.raises(ValueError, match="cut.gguf is truncated or corrupt"):
        read_gguf_header(tmp_path / "cut.gguf")


def test_load_picks_the_gguf_or_the_tokenizer_json(tmp_path):
    gguf_dir = tmp_path / "model"
    gguf_dir.mkdir()
    path = _write_sentencepiece(gguf_dir / "model.gguf")
    assert Tokenizer.load(path).bos_token == Tokenizer.load(gguf_dir).bos_token == "<s>"
    assert Tokenizer.load(gguf_dir).encode("hi") == Tokenizer.from_gguf(path).encode("hi")
    other = _write_byte_level(gguf_dir / "other.gguf", "qwen2")
    with pytest.raises(FileNotFoundError, match="2 .gguf files"):
        Tokenizer.load(gguf_dir)
    load_gguf_tokenizer(other).tokenizer.save(str(gguf_dir / "tokenizer.json"))
    assert Tokenizer.load(gguf_dir).encode("hi 😀") == Tokenizer.from_gguf(other).encode("hi 😀")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.load(tmp_path / "missing")
