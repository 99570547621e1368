"""An Anthropic Messages request in chat's terms: system and content blocks as chat messages, tools
with input_schema as functions, tool_choice, thinking as the template's enable_thinking, and
output_config's JSON schema as the output's constraint."""
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.gateway.anthropic_schemas import (CountTokensRequest, DocumentBlock, ImageBlock, InputBlock,
                                                  MessageParam, OutputConfig, RedactedThinkingBlock, TextBlock,
                                                  ThinkingBlock, ThinkingConfig, ToolChoice, ToolChoiceAny,
                                                  ToolChoiceNone, ToolChoiceTool, ToolParam, ToolResultBlock,
                                                  ToolUseBlock)
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.schemas import (ChatMessage, FunctionCallIn, FunctionDefinition, NamedFunction,
                                        NamedToolChoice, Tool, ToolCallIn)


def chat_messages(req: CountTokensRequest) -> list[ChatMessage]:
    """The system prompt and the conversation as chat messages; a tool_result becomes a `tool` message."""
    messages = [] if req.system is None else [ChatMessage("system", _system_text(req.system))]
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            messages.append(ChatMessage(message.role, message.content))
        elif message.role == "user":
            messages += _user_messages(message.content, i)
        else:
            messages.append(_assistant_message(message, i))
    return messages


def prefill(req: CountTokensRequest) -> bool:
    """Whether the conversation ends with the assistant's turn, whose text the reply continues
    (Anthropic's prefill: the prompt ends inside that message, chat's continue_final_message); a 400
    where that turn holds more than text or ends in white space, as Anthropic refuses both, or
    where thinking is on, which would have to come first."""
    last, index = req.messages[-1], len(req.messages) - 1
    if last.role != "assistant":
        return False
    blocks = [last.content] if isinstance(last.content, str) else last.content
    if not all(isinstance(b, str | TextBlock) for b in blocks):
        raise bad_request("A prefilled assistant turn (the last message) may hold text only; end the "
                          "conversation with a user message to send tool calls or thinking.", param=f"messages[{index}]")
    text = "" if not blocks else blocks[-1] if isinstance(blocks[-1], str) else blocks[-1].text
    if text != text.rstrip():
        raise bad_request("The final assistant content cannot end with white space; trim it.",
                          param=f"messages[{index}]")
    if req.thinking is not None and req.thinking.type != "disabled":
        raise bad_request("A prefilled assistant turn cannot go with thinking, which would come before it; "
                          "turn thinking off or end the conversation with a user message.", param="thinking")
    return True


def _system_text(system: str | list[TextBlock]) -> str:
    return system if isinstance(system, str) else "\n".join(block.text for block in system)


def _user_messages(blocks: list[InputBlock], index: int) -> list[ChatMessage]:
    """The tool results first (a chat template expects them right after the calls), then the text."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        param = f"messages[{index}].content[{j}]"
        if isinstance(block, ToolResultBlock):
            results.append(ChatMessage("tool", _result_text(block, param), tool_call_id=block.tool_use_id))
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        elif not isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            _refuse(block, param, "user")
    return results + ([ChatMessage("user", "\n".join(texts))] if texts else [])


def _result_text(block: ToolResultBlock, param: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    for k, part in enumerate(block.content):
        if not isinstance(part, TextBlock):
            _refuse(part, f"{param}.content[{k}]", "tool_result")
    return "\n".join(part.text for part in block.content)


def _assistant_message(message: MessageParam, index: int) -> ChatMessage:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCallIn(FunctionCallIn(block.name, block.input), block.id))
        elif not isinstance(block, RedactedThinkingBlock):
            _refuse(block, f"messages[{index}].content[{j}]", "assistant")
    return ChatMessage("assistant", "\n".join(texts), tool_calls=calls or None,
                       reasoning="\n".join(thinking) if thinking else None)


def _refuse(block: InputBlock, param: str, where: str) -> None:
    kind = type(block).__struct_config__.tag
    if isinstance(block, (ImageBlock, DocumentBlock)):
        raise bad_request(f"Content blocks of type '{kind}' are not supported: this server serves text-only "
                          "models; send text blocks.", param=param)
    raise bad_request(f"A {where} message cannot hold a '{kind}' block; move it to the other role.", param=param)


def chat_tools(tools: list[ToolParam] | None) -> list[Tool] | None:
    """The client's tools as functions; a 400 for Anthropic's server tools, which run at Anthropic."""
    if not tools:
        return None
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise bad_request(f"Tools of type '{tool.type}' run on Anthropic's servers, not here; send your own "
                              "tools (name, description, input_schema).", param=f"tools[{i}].type")
    return [Tool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema))
            for t in tools]


def chat_tool_choice(choice: ToolChoice | None) -> str | NamedToolChoice | None:
    """auto, any, tool and none as chat's auto, required, a named function and none."""
    if choice is None:
        return None
    if isinstance(choice, ToolChoiceTool):
        return NamedToolChoice(function=NamedFunction(choice.name))
    if isinstance(choice, ToolChoiceAny):
        return "required"
    return "none" if isinstance(choice, ToolChoiceNone) else "auto"


def parallel_tool_calls(choice: ToolChoice | None) -> bool | None:
    return None if choice is None or choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use


def template_kwargs(thinking: ThinkingConfig | None, output: OutputConfig | None) -> dict | None:
    """`thinking` as the enable_thinking variable that reasoning models' templates read, and
    output_config's effort as reasoning_effort (gpt-oss's templates read it)."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking.type != "disabled"}
    if output is not None and output.effort is not None:
        kwargs["reasoning_effort"] = output.effort
    return kwargs or None


def constraint(output: OutputConfig | None) -> tuple[str, StructuredOutputsParams] | None:
    """output_config.format's JSON schema as the output's constraint, and its field."""
    if output is None or output.format is None:
        return None
    return "output_config.format", StructuredOutputsParams(json=output.format.schema)
