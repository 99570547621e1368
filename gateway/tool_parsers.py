"""Tool calls read from the model's text: the `hermes` format (Qwen2.5, Qwen3, QwQ, Hermes),
`llama3_json` (Llama 3.1/3.2; `llama4_json`, vLLM's other name for it), `mistral` (Mistral 7B
v0.3, Nemo, Small, Magistral), `phi4_mini_json` (Phi-4-mini), `pythonic` and `llama4_pythonic`
(Llama 3.2, Llama 4: Python call syntax, pythonic_calls.py), `qwen3_coder` and `qwen3_xml`
(Qwen3-Coder's XML, xml_calls.py), and the two that structured outputs force for tool_choice
`required` (a JSON array of calls) and named (the arguments alone).

Each parser is a scanner, made per choice, that reads the text as it grows (a stream's deltas, or
the whole text at once) and keeps its place, so every character is read once and a stream costs
time linear in its length. It answers with positions (call_scan.py): the content before the first
call is text[start:end], and a JSON format's call arguments text[call.start:call.end], the model's
own bytes cut by matching brackets outside strings (never re-serialized)."""
from collections.abc import Callable

from functools import partial

from pagedserve.gateway.call_scan import SPACE, CallObject, Calls, Opening, ParsedCall, Scan, SpaceSkipper, Tagged
from pagedserve.gateway.pythonic_calls import Pythonic
from pagedserve.gateway.schemas import Tool
from pagedserve.gateway.xml_calls import Qwen3Coder, property_types

PARSERS = ("hermes", "llama3_json", "llama4_json", "llama4_pythonic", "mistral", "phi4_mini_json", "pythonic",
           "qwen3_coder", "qwen3_xml")
# Parsers whose tags are special tokens, which the text must keep to be read (vLLM's adjust_request).
KEEP_SPECIAL_TOKENS = frozenset({"mistral"})


class Hermes(Tagged):
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
        if c in SPACE:
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
        self._opening = Opening(self.TAG)

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
        first = self._opening.find(text, start, final)
        if first is None:
            self._content = final
        elif text[first] == "{":
            self._calls = Calls(first, ";")
        else:
            self._content = True


class Mistral(Tagged):
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
        while self._pos < len(text) and text[self._pos] in SPACE:
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


class Phi4MiniJson(Tagged):
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
        self._space = SpaceSkipper()
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


Scanner = Hermes | Llama3Json | Mistral | Phi4MiniJson | Pythonic | Qwen3Coder | Required | Named


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


def parser(name: str, tools: list[Tool]) -> Callable[[], Scanner]:
    """The scanner factory of --tool-call-parser `name` for a request's `tools`."""
    if name in ("qwen3_coder", "qwen3_xml"):
        return partial(Qwen3Coder, property_types(tools))
    return {"hermes": hermes, "llama3_json": llama3_json, "llama4_json": llama3_json, "mistral": mistral,
            "phi4_mini_json": phi4_mini_json,
            "pythonic": Pythonic, "llama4_pythonic": Pythonic}[name]
