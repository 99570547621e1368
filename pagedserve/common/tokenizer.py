"""Tokenizer and chat template on the `tokenizers` library and jinja2, without transformers."""
import json
import re
from collections import Counter
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as RustTokenizer

from pagedserve.common.chat_template import ChatTemplateError, compile_template, content_format, render
from pagedserve.common.gguf_tokenizer import load_gguf_tokenizer


# Characters from which encoding goes through encode_batch (see Tokenizer.encode).
LONG_TEXT = 4096
# The variables that Tokenizer.chat_variables sets; template kwargs may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                "eos_token"})
# A chat template that renders messages of the roles "query" and "document" is a score template, vLLM's
# way to format a (query, document) pair for a decoder reranker (its --chat-template for Qwen3-Reranker).
_SCORE_ROLES = (re.compile(r"""["']query["']"""), re.compile(r"""["']document["']"""))


def _token_text(value: str | dict | None) -> str | None:
    # tokenizer_config.json writes special tokens as plain strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _select_template(value: str | list[dict] | None) -> str | None:
    # Older configs hold a list of named templates; "default" is the one for plain chat.
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value}
        return named.get("default")
    return value


def read_chat_template(value: str) -> str:
    """A chat template given as a file or inline, as vLLM's --chat-template takes it; raises
    ValueError (OSError for an unreadable file) when it is neither, or does not compile."""
    path = Path(value)
    if path.is_file():
        source = path.read_text()
    elif not any(c in value for c in "{}\n"):
        raise ValueError(f"{value} is neither a file nor a Jinja template; pass the template's file "
                         "or its text")
    else:
        source = value
    try:
        compile_template(source)
    except ChatTemplateError as e:
        raise ValueError(str(e)) from None
    return source


class Tokenizer:
    """Encodes, decodes and renders chats the way transformers' fast tokenizers do."""

    def __init__(self, tokenizer: RustTokenizer, config: dict, chat_template: str | None) -> None:
        self._tokenizer = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = compile_template(chat_template) if chat_template else None
        # How its template takes a message's content ("string" or "openai"; see content_format).
        self._content_format = content_format(chat_template) if chat_template else "string"
        self.has_score_template = bool(chat_template) and all(r.search(chat_template) for r in _SCORE_ROLES)
        # tokenizer.json's post-processor normally adds BOS; some configs ask for it without one.
        probe = tokenizer.encode("", add_special_tokens=True).ids
        self._prepend_bos = (config.get("add_bos_token") is True and self.bos_token_id is not None
                             and probe[:1] != [self.bos_token_id])
        self.separates_pairs = self._separates_pairs()

    def _separates_pairs(self) -> bool:
        # A cross-encoder's pair template puts a separator ([SEP], </s></s>) between the texts; a
        # decoder's adds nothing there, or its BOS again (vLLM joins the texts for those instead).
        single = self._tokenizer.encode("", add_special_tokens=True).ids
        pair = self._tokenizer.encode("", "", add_special_tokens=True).ids
        added = Counter(pair) - Counter(single)
        return any(token != self.bos_token_id for token in added.elements())

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> "Tokenizer":
        """Loads tokenizer.json, tokenizer_config.json and chat_template.jinja from a model dir;
        `chat_template` (--chat-template's text) replaces the model's template."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json; pass a model directory "
                                    "saved by transformers (a fast tokenizer) with --tokenizer")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        if chat_template is not None:
            template = chat_template
        elif template_file.is_file():
            template = template_file.read_text()
        else:
            template = _select_template(config.get("chat_template"))
        return cls(RustTokenizer.from_file(str(path / "tokenizer.json")), config, template)

    @classmethod
    def from_gguf(cls, path: str | Path, chat_template: str | None = None) -> "Tokenizer":
        """Builds the tokenizer and chat template from a GGUF file's metadata, as transformers does;
        `chat_template` replaces the file's template."""
        loaded = load_gguf_tokenizer(path)
        return cls(loaded.tokenizer, loaded.config, chat_template or loaded.chat_template)

    @classmethod
    def load(cls, path: str | Path, chat_template: str | None = None) -> "Tokenizer":
        """Loads a model's tokenizer: a .gguf file, a directory with tokenizer.json, or a directory
        holding one .gguf file and no tokenizer.json; `chat_template` replaces the model's."""
        path = Path(path)
        if path.is_file():
            return cls.from_gguf(path, chat_template)
        if not path.is_dir():
            raise FileNotFoundError(f"{path} does not exist; pass a model directory or a .gguf file")
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "tokenizer.json").is_file() or not ggufs:
            return cls.from_dir(path, chat_template)
        if len(ggufs) > 1:
            raise FileNotFoundError(f"{path} has no tokenizer.json and {len(ggufs)} .gguf files "
                                    f"({', '.join(g.name for g in ggufs)}); pass the .gguf file to use")
        return cls.from_gguf(ggufs[0], chat_template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def token_id(self, token: str) -> int:
        """The id of a vocabulary entry (transformers' convert_tokens_to_ids, of one token)."""
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{token!r} is not a token of this tokenizer's vocabulary")
        return token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < LONG_TEXT:
            ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        else:
            # encode_batch lets go of the GIL while it works and encode does not, so a long text
            # tokenized on a worker thread leaves the event loop running; it costs more on short texts.
            ids = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """Two texts as one input by the tokenizer's pair template (a cross-encoder's), and each id's
        token type: 0 in the first text, 1 in the second where the template says so."""
        encoding = self._tokenizer.encode(first, second, add_special_tokens=True)
        return encoding.ids, encoding.type_ids

    def encode_tail(self, text: str, max_tokens: int) -> list[int]:
        """encode(text) cut to at most `max_tokens` ids by dropping text tokens from its start: the
        special tokens stay, as transformers' truncation with truncation_side="left" keeps them."""
        return self._encode_cut(text, max_tokens, "left")

    def encode_head(self, text: str, max_tokens: int) -> list[int]:
        """encode(text) cut to at most `max_tokens` ids by dropping text tokens from its end, the
        special tokens kept (transformers' truncation_side="right")."""
        return self._encode_cut(text, max_tokens, "right")

    def _encode_cut(self, text: str, max_tokens: int, direction: str) -> list[int]:
        specials = self._tokenizer.num_special_tokens_to_add(False) + int(self._prepend_bos)
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        encoding.truncate(max(0, max_tokens - specials), direction=direction)
        ids = self._tokenizer.post_process(encoding).ids
        if self._prepend_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def to_json(self) -> str:
        """The `tokenizers` JSON of this tokenizer (added tokens included)."""
        return self._tokenizer.to_str()

    def content_format(self, template: str | None = None, given: str = "auto") -> str:
        """How a chat's content reaches `template` (None: this tokenizer's): `given`
        (--chat-template-content-format), or where it is "auto", what the template expects."""
        if given != "auto":
            return given
        return self._content_format if template is None else content_format(template)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it ("Ġworld" for " world" in a byte-level BPE)."""
        return [self._tokenizer.id_to_token(i) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template: str | None = None,
                            **kwargs: object) -> str:
        """Renders a chat to the prompt text; encode it with add_special_tokens=False. `tools` and
        the keyword arguments (e.g. enable_thinking) are template variables, as in transformers;
        `template` replaces the model's own."""
        variables = self.chat_variables(messages, add_generation_prompt, tools, kwargs)
        return self.render_chat(variables, None if template is None else compile_template(template))

    def render_chat(self, variables: dict, template: jinja2.Template | None = None) -> str:
        """The model's chat template (or `template`) rendered with chat_variables(); raises
        ChatTemplateError (see chat_template.render)."""
        compiled = template or self._template
        if compiled is None:
            raise ChatTemplateError("this model has no chat template (neither tokenizer_config.json, "
                                    "chat_template.jinja nor the GGUF metadata hold one); use "
                                    "/v1/completions with a plain prompt instead")
        return render(compiled, variables)

    def chat_variables(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
                       template_kwargs: dict | None, documents: list[dict] | None = None) -> dict:
        """What a chat template renders from: `template_kwargs`, then the variables every render
        sets (RESERVED_VARIABLES), which they cannot replace."""
        return {**(template_kwargs or {}), "messages": messages, "tools": tools, "documents": documents,
                "add_generation_prompt": add_generation_prompt, "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or ""}
