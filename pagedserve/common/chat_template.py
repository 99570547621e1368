"""Chat templates: compiled in jinja2's immutable sandbox, with the work one render may do bounded.

The sandbox keeps templates from reaching Python internals; BoundedSandbox also refuses the
operators that build huge values from small ones (`'x' * 10**9`, `9**9**9`), and render() stops
a template whose output passes MAX_RENDERED_CHARS. What a template can still do without end (loop,
pad with str.ljust) is bounded where untrusted templates run: gateway/template_worker.py."""
import json
from datetime import datetime
from functools import lru_cache

import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Most characters a render may produce: a request's text is at most a million characters
# (gateway/params.py), and a template that writes every message twice still fits.
MAX_RENDERED_CHARS = 2_000_000
# Largest integer a template may compute: Python refuses to print ints of more than 4300 digits
# (about 14 300 bits) anyway.
MAX_INT_BITS = 16_384


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template refused, failed or overran the conversation."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which transformers' templates do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _sized(value: object) -> bool:
    return isinstance(value, (str, list, tuple))


def _result_size(op: str, left: object, right: object) -> int:
    """The size of what `left op right` would build: items of a sequence, bits of an integer."""
    if op == "+":
        return len(left) + len(right) if _sized(left) and _sized(right) else 0
    if isinstance(left, int) and isinstance(right, int):
        if op == "*":
            return left.bit_length() + right.bit_length()
        return right * left.bit_length() if right > 0 and abs(left) > 1 else 0
    if op == "*" and _sized(left) != _sized(right):
        seq, times = (left, right) if _sized(left) else (right, left)
        return len(seq) * times if isinstance(times, int) else 0
    return 0


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, refusing `*`, `**` and `+` whose result would pass the caps (and, by
    intercepting them, keeping jinja2 from folding such constants while it compiles)."""
    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context, op: str, left, right):
        size = _result_size(op, left, right)
        limit = MAX_INT_BITS if isinstance(left, int) and isinstance(right, int) else MAX_RENDERED_CHARS
        if size > limit:
            raise SecurityError(f"`{op}` would build a value of size {size}; the limit is {limit}")
        return super().call_binop(context, op, left, right)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled (the latest 16 are kept); raises ChatTemplateError if it does not."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except Exception as e:
        # Deep nesting fails in Python's own compiler (IndentationError, RecursionError).
        raise ChatTemplateError(f"the chat template does not compile: {_reason(e)}") from None


# --chat-template-content-format's choices: how a message's content reaches the template.
CONTENT_FORMATS = ("auto", "string", "openai")


@lru_cache(maxsize=16)
def content_format(source: str) -> str:
    """"openai" where the template loops over a message's content, so expects it as a list of
    {"type": "text", "text": ...} parts; else "string", the parts joined by newlines (vLLM's
    detection for --chat-template-content-format auto). "string" for what does not parse."""
    try:
        tree = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(source)
    except Exception:
        return "string"
    loops = list(tree.find_all(nodes.For))
    lists = _names_from(tree, {"messages"})
    items = {loop.target.name for loop in loops
             if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, name) for name in lists)}
    return "openai" if any(_reads(loop.iter, item, "content") for loop in loops for item in items) else "string"


def with_content_format(messages: list[dict], form: str) -> list[dict]:
    """OpenAI's message dicts (content a string, a list of text parts, or null) with each content in
    `form`: "string", the parts' texts joined by newlines, or "openai", a list of text parts."""
    return [{**m, "content": _content(m.get("content"), form)} for m in messages]


def text_parts(texts: list[str]) -> list[dict]:
    return [{"type": "text", "text": text} for text in texts]


def final_text(content: str | list | None) -> str | None:
    """What a continued final message ends with: its text, or its last text part's (transformers'
    continue_final_message)."""
    if not isinstance(content, list):
        return content
    return next((part["text"] for part in reversed(content) if "text" in part), None)


def _content(content: str | list | None, form: str) -> str | list | None:
    if form == "string":
        return "\n".join(_texts(content)) if isinstance(content, list) else content
    return content if isinstance(content, list) else text_parts([] if content is None else [content])


def _texts(parts: list) -> list[str]:
    if any(not isinstance(part, dict) or part.get("type") != "text" for part in parts):
        raise ChatTemplateError("content parts other than text are not supported; send text parts only")
    return [part["text"] for part in parts]


def _names_from(tree: nodes.Template, names: set[str]) -> set[str]:
    """`names` and every variable a `set` derives from them (`set rest = messages[1:]`)."""
    names, grew = set(names), True
    while grew:
        grew = False
        for assign in tree.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in names and any(
                    _reads(assign.node, name) for name in names):
                names.add(target.name)
                grew = True
    return names


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` is variable `name` (or its `key` item), through filters, tests and slices."""
    while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is not None:
        by_item = isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key
        if not (by_item or isinstance(node, nodes.Getattr) and node.attr == key):
            return False
        node = node.node
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def render(template: jinja2.Template, variables: dict) -> str:
    """The template rendered; raises ChatTemplateError when it raises, fails or writes more than
    MAX_RENDERED_CHARS."""
    parts, size = [], 0
    try:
        for part in template.generate(**variables):
            size += len(part)
            if size > MAX_RENDERED_CHARS:
                raise ChatTemplateError(f"the chat template wrote more than {MAX_RENDERED_CHARS} characters")
            parts.append(part)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template rejected these messages: {_reason(e)}") from None
    except Exception as e:
        raise ChatTemplateError(f"the chat template failed: {_reason(e)}") from None
    return "".join(parts)


def continue_final(text: str, final: str | None) -> str:
    """`text`, a chat rendered without a generation prompt, cut where its final message's content
    `final` ends, so that generation continues that message (transformers' continue_final_message):
    the template's end-of-turn after it goes. Raises ChatTemplateError where the template does not
    write that content as given."""
    stripped = (final or "").strip()
    at = text.rfind(stripped) if stripped else -1
    if at < 0:
        raise ChatTemplateError("the final message cannot be continued: it holds no text, or the chat template "
                                "does not write its text as given")
    # A template may trim the message's trailing spaces; where it kept them, so does the prompt.
    kept = final.lstrip()
    return text[:at + (len(kept) if text.startswith(kept, at) else len(stripped))]


def _reason(e: Exception) -> str:
    # One line, short: the message reaches the client, and a template's error may quote the template.
    text = (str(e).strip().splitlines() or [""])[0]
    name = "" if isinstance(e, TemplateError) else f"{type(e).__name__}: "
    return (name + text)[:300]
