"""--tool-call-parser pythonic and llama4_pythonic: calls written as a Python list of calls,
[get_weather(city="Dallas", days=3), now()] (Llama 3.2, Llama 4, ToolACE), for Llama 4 between
<|python_start|> and <|python_end|>. As vLLM reads it, the output is calls only when it begins with
the list; otherwise all of it is content.

Each keyword's value is a Python literal, read once it ends (a comma or the closing parenthesis
outside brackets and strings, triple-quoted ones included) and appended to the call's arguments as
JSON, so the arguments of a call grow by whole values: `{"city": "Dallas"`, then `, "days": 3`,
then `}`, which join into what vLLM's json.dumps of the same keywords gives. A value that is no
literal (a name, an expression) ends the calls where it stands: those before it whole, the one it
is in with the arguments before it (as max_tokens leaves a call it cuts), none if it was that
call's first; a list that gives no call is content."""
import ast
import json

from pagedserve.gateway.call_scan import SPACE, Opening, ParsedCall, Scan, held_back

TAG, END_TAG = "<|python_start|>", "<|python_end|>"
_OPEN, _CLOSE = "([{", ")]}"


class Pythonic:
    """A scanner of one choice's text in Python call syntax."""

    def __init__(self) -> None:
        self._opening = Opening(TAG)
        self._content = False
        # Where the list's next unread character is, once the output has begun with it.
        self._pos: int | None = None
        self._state = "call"
        self._calls: list[ParsedCall] = []
        self._ended = False
        # The keyword and value being read: where the value began, its bracket depth, its open quote.
        self._key = ""
        self._value_start = 0
        self._depth = 0
        self._quote: str | None = None
        self._escaped = False

    def scan(self, text: str, start: int, final: bool) -> Scan:
        if self._pos is None and not self._content:
            self._decide(text, start, final)
        if self._content:
            return Scan(start, len(text))
        if self._pos is not None:
            self._read(text)
        # A call shows once it has an argument or has closed: a name whose first value turns out no
        # literal was never a call.
        shown = self._calls if not self._calls or self._calls[-1].built else self._calls[:-1]
        if not shown and (self._ended or final):
            return Scan(start, len(text))
        return Scan(start, start, shown)

    def _decide(self, text: str, start: int, final: bool) -> None:
        first = self._opening.find(text, start, final)
        if first is None:
            self._content = final
        elif text[first] == "[":
            self._pos = first + 1
        else:
            self._content = True

    def _read(self, text: str) -> None:
        while not self._ended and self._pos < len(text):
            read = self._read_value(text) if self._state == "value" else self._read_word(text)
            if not read:
                return

    def _read_word(self, text: str) -> bool:
        """Reads a call's name up to its "(", a keyword up to its "=", or what lies between them;
        False to wait for more text."""
        c = text[self._pos]
        if c in SPACE or c == ",":
            self._pos += 1
        elif self._state == "call" and c == "]":
            self._ended = True
        elif self._state == "arguments" and c == ")":
            self._close_call()
        else:
            return self._word(text, "(" if self._state == "call" else "=")
        return True

    def _word(self, text: str, end: str) -> bool:
        """An identifier up to `end`; anything else ends the calls."""
        found = text.find(end, self._pos)
        word = text[self._pos:len(text) if found < 0 else found].strip()
        if found < 0:
            # What has come of the word may still begin one.
            self._ended = not (word + "x").isidentifier()
            return self._ended
        if not word.isidentifier():
            self._ended = True
            return True
        self._pos = found + 1
        if end == "(":
            self._calls.append(ParsedCall(word, built=""))
            self._state = "arguments"
        else:
            self._key, self._value_start, self._state, self._depth = word, found + 1, "value", 0
        return True

    def _read_value(self, text: str) -> bool:
        """Reads a keyword's value up to its end, where it adds the argument; False to wait for more
        text."""
        i = self._pos
        while i < len(text):
            c = text[i]
            if c in "'\"" and not self._escaped and len(text) - i <= held_back(text, c * 3):
                # One or two quotes at the end of the text so far: a triple quote may be coming.
                self._pos = i
                return False
            if self._quote is not None:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif text.startswith(self._quote, i):
                    i += len(self._quote) - 1
                    self._quote = None
            elif c in "'\"":
                self._quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(self._quote) - 1
            elif c in _OPEN:
                self._depth += 1
            elif c in _CLOSE and self._depth:
                self._depth -= 1
            elif c in ",)" and not self._depth:
                self._pos = i
                self._add_argument(text[self._value_start:i])
                return True
            i += 1
        self._pos = i
        return False

    def _add_argument(self, literal: str) -> None:
        try:
            value = json.dumps(ast.literal_eval(literal.strip()), ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self._ended = True
            return
        self._calls[-1].add_built(self._key, value)
        self._state = "arguments"

    def _close_call(self) -> None:
        self._calls[-1].close_built()
        self._pos, self._state = self._pos + 1, "call"
