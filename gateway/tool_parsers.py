"""Tool calls read from the model's text: the `hermes` format (Qwen2.5, Qwen3, QwQ, Hermes),
`llama3_json` (Llama 3.1/3.2), and the two that structured outputs force for tool_choice
`required` (a JSON array of calls) and named (the arguments alone).

A parser scans the whole text so far and returns the content before the first call and each
call's name and arguments. The arguments are the model's own bytes, cut from the text by matching
braces outside strings (never re-serialized), so every scan of a longer text extends the previous
scan's arguments: a stream sends the new suffix, and the fragments add up to the non-stream value."""
import re
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json")
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_SPACE = " \t\r\n"


@dataclass(slots=True)
class ParsedCall:
    name: str | None
    arguments: str = ""
    # Whether the arguments are complete (their closing brace seen).
    complete: bool = False


@dataclass(slots=True)
class Scan:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at text[start] ends (one past its closing
    bracket), or None if the text ends first."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _call(obj: str) -> ParsedCall:
    """The call in `obj`, a whole or partial JSON object {"name": ..., "arguments": {...}}."""
    args = _ARGUMENTS.search(obj)
    head = obj if args is None else obj[:args.start()]
    name = _NAME.search(head)
    call = ParsedCall(None if name is None else name.group(1))
    if args is None or args.end() >= len(obj):
        return call
    start = args.end()
    if obj[start] not in "{[":
        # Not an object: taken whole once the call's object has closed.
        end = obj.rfind("}")
        call.arguments, call.complete = (obj[start:end].strip(), True) if end > start else ("", False)
        return call
    end = value_end(obj, start)
    call.arguments = obj[start:] if end is None else obj[start:end]
    call.complete = end is not None
    return call


def _objects(text: str, start: int, separators: str) -> list[ParsedCall]:
    """The calls in a run of JSON objects from text[start], between `separators` and spaces."""
    calls, i = [], start
    while i < len(text):
        if text[i] in separators or text[i] in _SPACE:
            i += 1
            continue
        if text[i] != "{":
            break
        end = value_end(text, i)
        calls.append(_call(text[i:] if end is None else text[i:end]))
        if end is None:
            break
        i = end
    return calls


def held_back(text: str, tag: str) -> int:
    """The length of text's longest suffix that could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def hermes(text: str, final: bool) -> Scan:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number of times."""
    start = text.find("<tool_call>")
    if start < 0:
        held = 0 if final else held_back(text, "<tool_call>")
        return Scan(text[:len(text) - held])
    calls = []
    while start >= 0:
        body = start + len("<tool_call>")
        end = text.find("</tool_call>", body)
        calls += _objects(text[:len(text) if end < 0 else end], body, "")
        start = -1 if end < 0 else text.find("<tool_call>", end)
    return Scan(text[:text.find("<tool_call>")], calls)


def llama3_json(text: str, final: bool) -> Scan:
    """{"name": ..., "parameters": {...}} (optionally after <|python_tag|>), `;`-separated; output
    that starts otherwise is content."""
    stripped = text.lstrip(_SPACE)
    tag = "<|python_tag|>"
    if stripped.startswith(tag):
        stripped = stripped[len(tag):].lstrip(_SPACE)
    elif tag.startswith(stripped) and not final:
        return Scan("")
    if not stripped and not final:
        return Scan("")
    if not stripped.startswith("{"):
        return Scan(text)
    return Scan("", _objects(stripped, 0, ";"))


def required(text: str, final: bool) -> Scan:
    """[{"name": ..., "parameters": {...}}, ...]: what tool_choice "required" forces."""
    start = text.find("[")
    return Scan("", [] if start < 0 else _objects(text, start + 1, ","))


def named(name: str):
    """The arguments alone: what a named tool_choice forces."""
    def scan(text: str, final: bool) -> Scan:
        body = text.lstrip(_SPACE)
        end = value_end(body, 0) if body.startswith("{") else None
        return Scan("", [ParsedCall(name, body if end is None else body[:end], end is not None or final)])
    return scan


def parser(name: str):
    return {"hermes": hermes, "llama3_json": llama3_json}[name]
