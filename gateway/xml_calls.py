"""--tool-call-parser qwen3_coder (and qwen3_xml, the same format): Qwen3-Coder's calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Dallas
    </parameter>
    </function>
    </tool_call>

What precedes the first <tool_call> is content. A parameter's value is its text less one newline
at each end, typed as vLLM's qwen3_coder parser types it by the tool's JSON schema: "null" is null;
an integer, number or boolean property is read as one (the text as it is where it reads as none);
an object or array as JSON, else a Python literal; a string property, or one the schema does not
name, stays text. Each call's arguments are built as JSON and grow by whole parameters, as they
close, so a stream's fragments join into the non-stream value (which matches vLLM's json.dumps)."""
import ast
import json

from pagedserve.gateway.call_scan import SPACE, ParsedCall, Scan, Tagged

FUNCTION, PARAMETER = "<function=", "<parameter="
END_PARAMETER, END_FUNCTION = "</parameter>", "</function>"
# A parameter without its closing tag ends where the next one or the function's end begins.
_VALUE_ENDS = (END_PARAMETER, PARAMETER, END_FUNCTION)
_LONGEST_END = max(map(len, _VALUE_ENDS))
_STRINGS = ("string", "str", "text", "varchar", "char", "enum")
_INTEGERS = ("int", "uint", "long", "short", "unsigned")


def property_types(tools: list) -> dict[str, dict[str, str]]:
    """{function name: {parameter: its JSON schema type, lower case}} of a request's tools."""
    types = {}
    for tool in tools:
        schema = tool.function.parameters or {}
        properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
        types[tool.function.name] = {name: _type_name(p) for name, p in properties.items()
                                     if isinstance(p, dict)}
    return types


def _type_name(schema: dict) -> str:
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower()


def typed(value: str, kind: str | None) -> object:
    """A parameter's text as the value its schema type says (None: a name the schema lacks)."""
    if value.lower() == "null":
        return None
    if kind is None or kind in _STRINGS:
        return value
    if kind.startswith(_INTEGERS):
        return _or_text(int, value)
    if kind.startswith(("num", "float")):
        number = _or_text(float, value)
        return int(number) if isinstance(number, float) and number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        parsed = _or_text(json.loads, value)
        if parsed is not value:
            return parsed
    return _or_text(ast.literal_eval, value)


def _or_text(read, value: str) -> object:
    try:
        return read(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


class Qwen3Coder(Tagged):
    """A scanner of one choice's text in Qwen3-Coder's XML calls."""
    TAG = "<tool_call>"

    def __init__(self, types: dict[str, dict[str, str]]) -> None:
        self._types = types
        self._first: int | None = None
        self._pos: int | None = None
        self._state = "between"
        self._calls: list[ParsedCall] = []
        self._key = ""
        self._value_start = 0

    def scan(self, text: str, start: int, final: bool) -> Scan:
        if self._pos is None:
            self._pos = start
        if self._first is None and not self._seek(text):
            return self._untagged(text, start, final)
        while self._step(text):
            pass
        return Scan(start, self._first, self._calls)

    def _step(self, text: str) -> bool:
        """Reads on from the current state; False to wait for more text."""
        if self._state == "between":
            return self._function(text)
        if self._state == "value":
            return self._value(text)
        while self._pos < len(text) and text[self._pos] in SPACE:
            self._pos += 1
        return self._parameter(text)

    def _function(self, text: str) -> bool:
        found = text.find(FUNCTION, self._pos)
        name_end = -1 if found < 0 else text.find(">", found)
        if name_end < 0:
            self._pos = max(self._pos, len(text) - len(FUNCTION)) if found < 0 else found
            return False
        self._calls.append(ParsedCall(text[found + len(FUNCTION):name_end].strip(), built=""))
        self._pos, self._state = name_end + 1, "parameters"
        return True

    def _parameter(self, text: str) -> bool:
        """A parameter's opening tag or the function's end; anything else is skipped."""
        rest = text[self._pos:self._pos + len(PARAMETER)]
        if rest.startswith(END_FUNCTION[:len(rest)]) or rest.startswith(PARAMETER[:len(rest)]):
            return self._tag(text)
        self._pos += 1
        return self._pos < len(text)

    def _tag(self, text: str) -> bool:
        if text.startswith(END_FUNCTION, self._pos):
            self._close_call()
            self._pos += len(END_FUNCTION)
            return True
        key_end = text.find(">", self._pos) if text.startswith(PARAMETER, self._pos) else -1
        if key_end < 0:
            return False
        self._key = text[self._pos + len(PARAMETER):key_end].strip()
        self._pos = self._value_start = key_end + 1
        self._state = "value"
        return True

    def _value(self, text: str) -> bool:
        ends = [(found, tag) for tag in _VALUE_ENDS if (found := text.find(tag, self._pos)) >= 0]
        if not ends:
            self._pos = max(self._pos, len(text) - _LONGEST_END)
            return False
        end, tag = min(ends)
        self._add_argument(text[self._value_start:end])
        self._pos = end + len(END_PARAMETER) if tag == END_PARAMETER else end
        self._state = "parameters"
        return True

    def _add_argument(self, value: str) -> None:
        value = value.removeprefix("\n").removesuffix("\n")
        call = self._calls[-1]
        kind = self._types.get(call.name, {}).get(self._key)
        try:
            typed_value = json.dumps(typed(value, kind), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            # A literal JSON cannot hold (a set, bytes, an infinity) stays the model's text.
            typed_value = json.dumps(value, ensure_ascii=False)
        call.add_built(self._key, typed_value)

    def _close_call(self) -> None:
        self._calls[-1].close_built()
        self._state = "between"
