"""Tokenizer and chat template on the `tokenizers` library and jinja2, without transformers."""
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2.ext
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

from pagedserve.common.gguf_tokenizer import load_gguf_tokenizer


# Characters from which encoding goes through encode_batch (see Tokenizer.encode).
LONG_TEXT = 4096


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template refused the conversation."""


def _token_text(value: str | dict | None) -> str | None:
    # tokenizer_config.json writes special tokens as plain strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which transformers' templates do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _select_template(value: str | list[dict] | None) -> str | None:
    # Older configs hold a list of named templates; "default" is the one for plain chat.
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value}
        return named.get("default")
    return value


# Templates that requests bring (`chat_template`) are compiled once each.
@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


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
        _compile(source)
    except TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None
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
        self._template = _compile(chat_template) if chat_template else None
        # tokenizer.json's post-processor normally adds BOS; some configs ask for it without one.
        probe = tokenizer.encode("", add_special_tokens=True).ids
        self._prepend_bos = (config.get("add_bos_token") is True and self.bos_token_id is not None
                             and probe[:1] != [self.bos_token_id])

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

    def to_json(self) -> str:
        """The `tokenizers` JSON of this tokenizer (added tokens included)."""
        return self._tokenizer.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template: str | None = None,
                            **kwargs: object) -> str:
        """Renders a chat to the prompt text; encode it with add_special_tokens=False. `tools` and
        the keyword arguments (e.g. enable_thinking) are template variables, as in transformers;
        `template` replaces the model's own."""
        try:
            compiled = self._template if template is None else _compile(template)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from e
        if compiled is None:
            raise ChatTemplateError("this model has no chat template (neither tokenizer_config.json, "
                                    "chat_template.jinja nor the GGUF metadata hold one); use "
                                    "/v1/completions with a plain prompt instead")
        variables = {**kwargs, "messages": messages, "tools": tools, "documents": None,
                     "add_generation_prompt": add_generation_prompt, "bos_token": self.bos_token or "",
                     "eos_token": self.eos_token or ""}
        try:
            return compiled.render(**variables)
        # A template that adds or iterates a field these messages lack (None) raises TypeError.
        except (TemplateError, TypeError) as e:
            raise ChatTemplateError(f"the chat template rejected these messages: {e}") from e
