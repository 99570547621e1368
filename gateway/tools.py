"""tool_choice: how a chat request's tools are used. `none` renders them and parses nothing;
`auto` parses what the model writes with the server's --tool-call-parser; `required` and a named
function are forced through structured outputs (vLLM's schemas), so the call is always valid."""
import json

from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.gateway import tool_parsers
from pagedserve.gateway.chat_output import ChatOutputOptions
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.schemas import NamedToolChoice, Tool

_ANY_OBJECT = {"type": "object"}


def tool_options(tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool | None,
                 tool_parser: str | None, options: ChatOutputOptions) -> StructuredOutputsParams | None:
    """Sets `options`' tool scan for the request's tool_choice; returns the constraint that
    forces the calls, if any. A 400 for a choice the request or the server cannot honour."""
    if not tools:
        if choice is not None and choice != "none":
            raise bad_request("`tool_choice` needs `tools`; add the tools or remove `tool_choice`.",
                              param="tool_choice")
        return None
    choice = choice or "auto"
    if choice == "none":
        return None
    if choice == "auto":
        if tool_parser is None:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                              'to be set; start the server with them, or send tool_choice "required", '
                              '"none" or a named function.', param="tool_choice")
        options.tools, options.finish_with_calls = tool_parsers.parser(tool_parser, tools), True
        options.keep_special_tokens |= tool_parser in tool_parsers.KEEP_SPECIAL_TOKENS
        return None
    if isinstance(choice, NamedToolChoice):
        tool = _named(tools, choice.function.name)
        options.tools = tool_parsers.named(tool.function.name)
        return StructuredOutputsParams(json=tool.function.parameters or _ANY_OBJECT)
    options.tools, options.finish_with_calls = tool_parsers.required, True
    return StructuredOutputsParams(json=required_schema(tools, parallel is not False))


def _named(tools: list[Tool], name: str) -> Tool:
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        names = ", ".join(repr(t.function.name) for t in tools)
        raise bad_request(f"`tool_choice` names the function {name!r}, which is not among the tools "
                          f"({names}); name one of them.", param="tool_choice")
    return tool


def required_schema(tools: list[Tool], parallel: bool) -> dict:
    """A JSON array of at least one call, {"name": <a tool's name>, "parameters": <its schema>}
    (at most one without parallel_tool_calls)."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"enum": [t.function.name]},
                             "parameters": t.function.parameters or _ANY_OBJECT}} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def arguments_object(arguments: str) -> dict:
    """A call's arguments (JSON text) as the object that Anthropic's tool_use and Ollama's tool_calls
    hold; {} for arguments that are no object, as when max_tokens cut them short."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
