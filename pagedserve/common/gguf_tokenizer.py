"""A `tokenizers.Tokenizer` built from a GGUF file's metadata, the way transformers builds one.

transformers (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, integrations/gguf) is the
reference: the same model, pre-tokenizer, decoder, special tokens and post-processor, so that token
ids, decoded text and chat prompts match it exactly.
"""
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from pagedserve.common.gguf_metadata import read_gguf_metadata

# llama.cpp's token types.
_CONTROL, _USER_DEFINED = 3, 4
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
# Architectures whose sentencepiece vocabulary transformers rebuilds differently from Llama's.
_OTHER_SENTENCEPIECE = ("gemma", "gemma2", "gemma3", "phi3")

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` names transformers maps to a split regex; any other name (SmolLM2's
# "smollm", GPT-2's "gpt-2", ...) keeps the GPT-2 regex of the byte-level pre-tokenizer.
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


@dataclass(slots=True)
class GGUFTokenizer:
    tokenizer: RustTokenizer
    # bos/eos/unk/pad token texts and add_bos_token/add_eos_token, as tokenizer_config.json has them.
    config: dict
    chat_template: str | None


def load_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """Builds the tokenizer, its special tokens and its chat template from a GGUF file."""
    meta = read_gguf_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise FileNotFoundError(f"{path} holds no tokenizer (no tokenizer.ggml.tokens); pass a tokenizer "
                         "directory with --tokenizer")
    tokenizer = _build_model(meta, model, path)
    config = _config(meta, model)
    _add_special_tokens(tokenizer, meta, [config[name] for name in _SPECIAL_IDS if name in config])
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.post_processor = _post_processor(config, tokenizer)
    return GGUFTokenizer(tokenizer, config, meta.get("tokenizer.chat_template"))


def _build_model(meta: dict, model: str | None, path: str | Path) -> RustTokenizer:
    architecture = meta.get("general.architecture")
    if model == "gpt2":
        return _byte_level_bpe(meta)
    if model == "llama" and architecture not in _OTHER_SENTENCEPIECE:
        return _sentencepiece_bpe(meta)
    raise ValueError(f"{path} has a {model!r} tokenizer (architecture {architecture!r}); only 'gpt2' "
                     "(byte-level BPE) and 'llama' (sentencepiece BPE) can be built from a GGUF: pass "
                     "the model's Hugging Face tokenizer directory with --tokenizer")


def _byte_level_bpe(meta: dict) -> RustTokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet is stored as its text; BPE wants it spelled byte by byte.
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
             for index, token in enumerate(meta["tokenizer.ggml.tokens"])}
    tokenizer = RustTokenizer(models.BPE(vocab, _merges(meta), dropout=None, continuing_subword_prefix="",
                                         end_of_word_suffix="", fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict) -> RustTokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _merges(meta) if "tokenizer.ggml.merges" in meta else _merges_from_scores(vocab, meta)
    tokenizer = RustTokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                       split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    return tokenizer


def _merges(meta: dict) -> list[tuple[str, ...]]:
    return [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges", ())]


def _merges_from_scores(vocab: dict[str, int], meta: dict) -> list[tuple[str, str]]:
    # Sentencepiece files list no merges: every split of a token into two known tokens is one,
    # ranked by the token's score (transformers' generate_merges).
    if "tokenizer.ggml.scores" not in meta:
        raise ValueError("this GGUF's sentencepiece vocabulary has neither merges nor scores, so its "
                         "merges cannot be derived; pass a tokenizer directory with --tokenizer")
    merges = []
    for token, score in dict(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"])).items():
        splits = [(token[:i], token[i:], score) for i in range(1, len(token))
                  if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tokenizer: RustTokenizer, meta: dict, named: list[str]) -> None:
    tokens = meta["tokenizer.ggml.tokens"]
    byte_level = meta.get("tokenizer.ggml.model") == "gpt2"
    types = meta.get("tokenizer.ggml.token_type") or ()
    alphabet = set(_bytes_to_unicode().values())
    # A byte-level "control" token outside the byte alphabet is a llama.cpp mislabel; transformers
    # skips it, since adding it would grow the vocabulary past the model's.
    control = [AddedToken(token, normalized=False, special=True) for token, kind in zip(tokens, types)
               if kind == _CONTROL and (not byte_level or set(token) <= alphabet)]
    tokenizer.add_special_tokens(control)
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False)
                          for token, kind in zip(tokens, types) if kind == _USER_DEFINED and token in vocab])
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in named])


def _config(meta: dict, model: str | None) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    config = {name: tokens[meta[f"tokenizer.ggml.{key}"]] for name, key in _SPECIAL_IDS.items()
              if f"tokenizer.ggml.{key}" in meta}
    # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
    config["add_bos_token"] = meta.get("tokenizer.ggml.add_bos_token", model == "llama")
    config["add_eos_token"] = meta.get("tokenizer.ggml.add_eos_token", False)
    return config


def _post_processor(config: dict, tokenizer: RustTokenizer) -> processors.TemplateProcessing:
    bos = config.get("bos_token") if config["add_bos_token"] else None
    eos = config.get("eos_token") if config["add_eos_token"] else None
    single = " ".join(filter(None, [bos and f"{bos}:0", "$A:0", eos and f"{eos}:0"]))
    pair = " ".join(filter(None, [single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1"]))
    special = [(token, tokenizer.token_to_id(token)) for token in (bos, eos) if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte alphabet: printable bytes stand for themselves, the rest move above U+00FF.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
