"""Tool calls read from the model's text: the `hermes` format (Qwen2.5, Qwen3, QwQ, Hermes),
`llama3_json` (Llama 3.1/3.2), `mistral` (Mistral 7B v0.3, Nemo, Small, Magistral),
`phi4_mini_json` (Phi-4-mini), and the two that structured outputs force for tool_choice
`required` (a JSON array of calls) and named (the arguments alone).

Each parser is a scanner, made per choice, that reads the text as it grows (a stream's deltas, or
the whole text at once) and keeps its place, so every character is read once and a stream costs
time linear in its length. It answers with positions: the content before the first call is
text[start:end], and each call's arguments text[call.start:call.end], the model's own bytes cut by
matching brackets outside strings (never re-serialized). A longer text only extends them, so a
stream sends their new suffixes and the fragments add up to the non-stream value."""
import re
from collections.abc import Callable
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral", "phi4_mini_json")
# Parsers whose tags are special tokens, which the text must keep to be read (vLLM's adjust_request).
KEEP_SPECIAL_TOKENS = frozenset({"mistral"})
_SPACE = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")
# What ends a run of string characters: its closing quote, or an escape.
_STRING_STOP = re.compile(r'["\\]')


@dataclass(slots=True)
class ParsedCall:
    name: str | None = None
    # Its arguments are text[start:end]; empty until they begin.
    start: int = 0
    end: int = 0
    # Whether the arguments are complete (their closing bracket seen).
    complete: bool = False


@dataclass(slots=True)
class Scan:
    """The content, text[start:end], and the calls found so far."""
    start: int
    end: int
    calls: list[ParsedCall] = field(default_factory=list)


def held_back(text: str, tag: str) -> int:
    """The length of text's longest suffix that could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class CallObject:
    """One call's JSON object, {"name": ..., "arguments": ...}, read as it arrives from its opening
    brace. Keys count at the object's top level: the first "arguments" (or "parameters") value is
    the call's arguments, an object or array up to its closing bracket, any other value whole
    (stripped) once the object closes; a "name" string before it is the call's name (after it, the
    call has been streamed without one)."""

    def __init__(self, start: int) -> None:
        self.call = ParsedCall()
        self.pos = start + 1
        self.depth = 1
        self.in_string = False
        self.escaped = False
        self.string_start = 0
        # What the top level expects next: "key", ":", "value" or "," (after a value).
        self.expect = "key"
        self.key: str | None = None
        self.value_key: str | None = None
        self.arguments_seen = False
        self.arguments_open = False
        self.scalar_arguments: int | None = None

    def read(self, text: str) -> bool:
        """Reads what arrived since the last read; True once the object has closed (then `pos` is
        one past its closing brace)."""
        i, n = self.pos, len(text)
        while i < n:
            if self.in_string:
                i = self._read_string(text, i)
                continue
            c = text[i]
            if c == '"':
                self.in_string, self.string_start = True, i
                self._value_starts(i, container=False)
            elif c in "{[":
                self._value_starts(i, container=True)
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1 and self.arguments_open:
                    self.arguments_open = False
                    self.call.end, self.call.complete = i + 1, True
                elif self.depth == 0:
                    self._close(text, i)
                    self.pos = i + 1
                    return True
            elif self.depth == 1 and c not in _SPACE:
                self._punctuation(c, i)
            i += 1
        self.pos = n
        if self.arguments_open:
            self.call.end = n
        return False

    def _read_string(self, text: str, i: int) -> int:
        if self.escaped:
            self.escaped = False
            return i + 1
        stop = _STRING_STOP.search(text, i)
        if stop is None:
            return len(text)
        i = stop.start()
        if text[i] == "\\":
            self.escaped = True
        else:
            self.in_string = False
            if self.depth == 1:
                self._string_ends(text[self.string_start + 1:i])
        return i + 1

    def _punctuation(self, c: str, i: int) -> None:
        if c == ":" and self.expect == ":":
            self.expect = "value"
        elif c == ",":
            self.expect = "key"
        else:
            self._value_starts(i, container=False)

    def _value_starts(self, i: int, container: bool) -> None:
        if self.depth != 1 or self.expect != "value":
            return
        self.expect, self.value_key = ",", self.key
        if self.key not in _ARGUMENT_KEYS or self.arguments_seen:
            return
        self.arguments_seen = True
        if container:
            self.arguments_open = True
            self.call.start = self.call.end = i
        else:
            self.scalar_arguments = i

    def _string_ends(self, value: str) -> None:
        if self.expect == "key":
            self.key, self.expect = value, ":"
        elif self.value_key == "name" and self.call.name is None and not self.arguments_seen:
            self.call.name = value

    def _close(self, text: str, brace: int) -> None:
        start = self.scalar_arguments
        if start is None:
            return
        end = brace
        while end > start and text[end - 1].isspace():
            end -= 1
        self.call.start, self.call.end, self.call.complete = start, end, True


class Calls:
    """A run of call objects from `pos`, between `separators` and spaces; anything else ends it."""

    def __init__(self, pos: int, separators: str) -> None:
        self.pos = pos
        self.separators = separators + _SPACE
        self.calls: list[ParsedCall] = []
        self._object: CallObject | None = None
        self._ended = False

    def read(self, text: str) -> None:
        while not self._ended:
            if self._object is not None:
                if not self._object.read(text):
                    return
                self.pos, self._object = self._object.pos, None
            while self.pos < len(text) and text[self.pos] in self.separators:
                self.pos += 1
            if self.pos == len(text):
                return
            if text[self.pos] != "{":
                self._ended = True
                return
            self._object = CallObject(self.pos)
            self.calls.append(self._object.call)


class _SpaceSkipper:
    """The first non-space position from some start, found across reads without reading twice."""

    def __init__(self) -> None:
        self.pos: int | None = None

    def find(self, text: str, start: int) -> int | None:
        i = start if self.pos is None else self.pos
        while i < len(text) and text[i] in _SPACE:
            i += 1
        self.pos = i
        return i if i < len(text) else None


class _Tagged:
    """A format whose calls follow a tag: what precedes the first tag is content."""
    TAG: str
    _first: int | None
    _pos: int

    def _seek(self, text: str) -> bool:
        """Moves past the next tag (noting where the first began); False where none has come yet."""
        found = text.find(self.TAG, self._pos)
        if found < 0:
            self._pos = max(self._pos, len(text) - len(self.TAG) + 1)
            return False
        if self._first is None:
            self._first = found
        self._pos = found + len(self.TAG)
        return True

    def _untagged(self, text: str, start: int, final: bool) -> Scan:
        """The scan while no tag has come: content, but for what may begin one (until final)."""
        return Scan(start, max(start, len(text) - (0 if final else held_back(text, self.TAG))))


class Hermes(_Tagged):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number of times."""
    TAG, END_TAG = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._first: int | None = None
        self._pos: int | None = None
        # Looking for the next <tool_call> (before the first, and after text that is no call).
        self._skipping = True
        self._object: CallObject | None = None
        self._calls: list[ParsedCall] = []

    def scan(self, text: str, start: int, final: bool) -> Scan:
        if self._pos is None:
            self._pos = start
        self._read(text, final)
        if self._first is None:
            return self._untagged(text, start, final)
        return Scan(start, self._first, self._calls)

    def _read(self, text: str, final: bool) -> None:
        while self._pos < len(text):
            if self._object is not None:
                if not self._object.read(text):
                    return
                self._pos, self._object = self._object.pos, None
            elif self._skipping:
                if not self._skip_to_tag(text):
                    return
            elif not self._read_between(text, final):
                return

    def _skip_to_tag(self, text: str) -> bool:
        if not self._seek(text):
            return False
        self._skipping = False
        return True

    def _read_between(self, text: str, final: bool) -> bool:
        """Reads what lies between calls: spaces and tags; False to wait for more text."""
        c = text[self._pos]
        if c in _SPACE:
            self._pos += 1
        elif c == "{":
            self._object = CallObject(self._pos)
            self._calls.append(self._object.call)
        elif text.startswith(self.END_TAG, self._pos):
            self._pos += len(self.END_TAG)
        elif text.startswith(self.TAG, self._pos):
            self._pos += len(self.TAG)
        elif not final and self._may_begin_tag(text[self._pos:self._pos + len(self.END_TAG)]):
            return False
        else:
            self._skipping = True
        return True

    def _may_begin_tag(self, rest: str) -> bool:
        return len(rest) < len(self.END_TAG) and (self.TAG.startswith(rest) or self.END_TAG.startswith(rest))


class Llama3Json:
    """{"name": ..., "parameters": {...}} (optionally after <|python_tag|>), `;`-separated; output
    that starts otherwise is content."""
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._calls: Calls | None = None
        self._content = False
        self._space = _SpaceSkipper()
        self._after_tag = False

    def scan(self, text: str, start: int, final: bool) -> Scan:
        if self._calls is None and not self._content:
            self._decide(text, start, final)
        if self._content:
            return Scan(start, len(text))
        if self._calls is None:
            return Scan(start, start)
        self._calls.read(text)
        return Scan(start, start, self._calls.calls)

    def _decide(self, text: str, start: int, final: bool) -> None:
        first = self._space.find(text, start)
        if first is None:
            self._content = final
        elif not self._after_tag and text.startswith(self.TAG, first):
            self._after_tag, self._space.pos = True, first + len(self.TAG)
            self._decide(text, start, final)
        elif (not final and not self._after_tag and len(text) - first < len(self.TAG)
              and self.TAG.startswith(text[first:])):
            return
        elif text[first] == "{":
            self._calls = Calls(first, ";")
        else:
            self._content = True


class Mistral(_Tagged):
    """[TOOL_CALLS] then the calls: a JSON array of {"name": ..., "arguments": {...}} (tokenizers
    before v11: Mistral 7B v0.3, Nemo), or name[ARGS]{...} after each [TOOL_CALLS] (v11 on: Small
    3.2, Magistral, Devstral). What precedes the first [TOOL_CALLS] is content."""
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self) -> None:
        self._first: int | None = None
        self._pos: int | None = None
        self._state = "content"
        self._array: Calls | None = None
        self._object: CallObject | None = None
        self._calls: list[ParsedCall] = []

    def scan(self, text: str, start: int, final: bool) -> Scan:
        if self._pos is None:
            self._pos = start
        while self._step(text):
            pass
        if self._first is None:
            return self._untagged(text, start, final)
        return Scan(start, self._first, self._array.calls if self._array else self._calls)

    def _step(self, text: str) -> bool:
        """Reads on from the current state; False to wait for more text."""
        if self._state == "content":
            return self._find_tag(text)
        if self._state == "array":
            self._array.read(text)
            return False
        while self._pos < len(text) and text[self._pos] in _SPACE:
            self._pos += 1
        if self._pos == len(text):
            return False
        return self._after_tag(text) if self._state == "tag" else self._arguments(text)

    def _find_tag(self, text: str) -> bool:
        if not self._seek(text):
            return False
        self._state = "tag"
        return True

    def _after_tag(self, text: str) -> bool:
        if text[self._pos] in "[{" and not self._calls:
            self._array = Calls(self._pos + (text[self._pos] == "["), ",")
            self._state = "array"
            return True
        args = text.find(self.ARGS, self._pos)
        if args < 0:
            return False
        self._calls.append(ParsedCall(text[self._pos:args].strip()))
        self._pos, self._state = args + len(self.ARGS), "arguments"
        return True

    def _arguments(self, text: str) -> bool:
        call = self._calls[-1]
        if self._object is None:
            if text[self._pos] != "{":
                self._state = "content"
                return True
            self._object, call.start = CallObject(self._pos), self._pos
        closed = self._object.read(text)
        call.end, call.complete = (self._object.pos if closed else len(text)), closed
        if closed:
            self._pos, self._object, self._state = self._object.pos, None, "content"
        return closed


class Phi4MiniJson(_Tagged):
    """functools[{"name": ..., "arguments": {...}}, ...] (Phi-4-mini); what precedes it is content."""
    TAG = "functools["

    def __init__(self) -> None:
        self._first: int | None = None
        self._pos: int | None = None
        self._calls: Calls | None = None

    def scan(self, text: str, start: int, final: bool) -> Scan:
        if self._pos is None:
            self._pos = start
        if self._calls is None and self._seek(text):
            self._calls = Calls(self._pos, ",")
        if self._calls is None:
            return self._untagged(text, start, final)
        self._calls.read(text)
        return Scan(start, self._first, self._calls.calls)


class Required:
    """[{"name": ..., "parameters": {...}}, ...]: what tool_choice "required" forces."""

    def __init__(self) -> None:
        self._searched: int | None = None
        self._calls: Calls | None = None

    def scan(self, text: str, start: int, final: bool) -> Scan:
        if self._calls is None:
            bracket = text.find("[", start if self._searched is None else self._searched)
            self._searched = len(text)
            if bracket < 0:
                return Scan(start, start)
            self._calls = Calls(bracket + 1, ",")
        self._calls.read(text)
        return Scan(start, start, self._calls.calls)


class Named:
    """The arguments alone: what a named tool_choice forces."""

    def __init__(self, name: str) -> None:
        self._call = ParsedCall(name)
        self._space = _SpaceSkipper()
        self._object: CallObject | None = None
        self._body: int | None = None

    def scan(self, text: str, start: int, final: bool) -> Scan:
        if self._body is None:
            self._body = self._space.find(text, start)
        call = self._call
        if self._body is not None and not call.complete:
            if text[self._body] == "{" and self._object is None:
                self._object = CallObject(self._body)
            closed = self._object is not None and self._object.read(text)
            call.start, call.end = self._body, self._object.pos if closed else len(text)
            call.complete = closed
        call.complete = call.complete or final
        return Scan(start, start, [call])


Scanner = Hermes | Llama3Json | Mistral | Phi4MiniJson | Required | Named


def hermes() -> Hermes:
    return Hermes()


def llama3_json() -> Llama3Json:
    return Llama3Json()


def mistral() -> Mistral:
    return Mistral()


def phi4_mini_json() -> Phi4MiniJson:
    return Phi4MiniJson()


def required() -> Required:
    return Required()


def named(name: str) -> Callable[[], Named]:
    """The scanner factory of a named tool_choice."""
    return lambda: Named(name)


def parser(name: str) -> Callable[[], Scanner]:
    return {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral, "phi4_mini_json": phi4_mini_json}[name]
