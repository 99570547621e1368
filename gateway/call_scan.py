"""The floor the tool-call scanners stand on: a found call and a scan's answer as positions in the
model's text, and the readers they share: a call's JSON object read as it arrives (`CallObject`), a
run of them (`Calls`), and the tag that starts a format's calls (`Tagged`).

A longer text only extends what a scan found, so a stream sends the new suffixes and the fragments
add up to the non-stream value. A format whose arguments are no JSON builds them (`ParsedCall.built`)
and only appends to them."""
import json
import re
from dataclasses import dataclass, field

SPACE = " \t\r\n"
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
    # Arguments built as JSON, for a format whose own are no JSON; then start and end index this.
    built: str | None = None

    def add_built(self, key: str, value_json: str) -> None:
        """Appends one argument to the built JSON (left open until close_built)."""
        self.built += ("{" if not self.built else ", ") + json.dumps(key, ensure_ascii=False) + ": " + value_json
        self.end = len(self.built)

    def close_built(self) -> None:
        """Closes the built JSON object: the call is complete."""
        self.built += "}" if self.built else "{}"
        self.end, self.complete = len(self.built), True

    def arguments(self, text: str, sent: int = 0) -> str:
        """The arguments found so far in the model's `text`, from where those `sent` end."""
        return (text if self.built is None else self.built)[max(self.start, sent):self.end]


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
            elif self.depth == 1 and c not in SPACE:
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
        self.separators = separators + SPACE
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


class SpaceSkipper:
    """The first non-space position from some start, found across reads without reading twice."""

    def __init__(self) -> None:
        self.pos: int | None = None

    def find(self, text: str, start: int) -> int | None:
        i = start if self.pos is None else self.pos
        while i < len(text) and text[i] in SPACE:
            i += 1
        self.pos = i
        return i if i < len(text) else None


class Opening:
    """Where a format's calls begin when they open the output (after spaces, and its tag if any):
    the first other character's position, found across reads without reading twice."""

    def __init__(self, tag: str) -> None:
        self._tag = tag
        self._space = SpaceSkipper()
        self._after_tag = False

    def find(self, text: str, start: int, final: bool) -> int | None:
        """That position; None while there is none yet (only spaces, or what may begin the tag)."""
        first = self._space.find(text, start)
        if first is None:
            return None
        if not self._after_tag and text.startswith(self._tag, first):
            self._after_tag, self._space.pos = True, first + len(self._tag)
            return self.find(text, start, final)
        if not final and not self._after_tag and self._tag.startswith(text[first:]):
            return None
        return first


class Tagged:
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
