"""An Ollama /api/chat or /api/generate request in chat's terms: messages, tool calls with object
arguments, options as sampling fields, format as a constraint, think as enable_thinking."""
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.ollama_schemas import Format, GenerateRequest, Message
from pagedserve.gateway.schemas import ChatMessage, FunctionCallIn, ToolCallIn


def chat_messages(messages: list[Message]) -> list[ChatMessage]:
    return [_chat_message(m, i) for i, m in enumerate(messages)]


def _chat_message(m: Message, index: int) -> ChatMessage:
    if m.images:
        raise bad_request("Images are not supported: this server serves text-only models; remove `images`.",
                          param=f"messages[{index}].images")
    calls = [ToolCallIn(FunctionCallIn(c.function.name, c.function.arguments)) for c in m.tool_calls or ()]
    return ChatMessage(m.role, m.content, name=m.tool_name, tool_calls=calls or None, reasoning=m.thinking)


def generate_messages(req: GenerateRequest) -> list[ChatMessage]:
    """The prompt as a user turn after the system prompt: Ollama renders /api/generate with the template."""
    check_generate(req)
    system = [] if req.system is None else [ChatMessage("system", req.system)]
    return [*system, ChatMessage("user", req.prompt)]


def check_generate(req: GenerateRequest) -> None:
    """A 400 for the /api/generate fields this server cannot honour."""
    if req.images:
        raise bad_request("Images are not supported: this server serves text-only models; remove `images`.",
                          param="images")
    unsupported = [name for name in ("suffix", "template", "context") if getattr(req, name)]
    if unsupported:
        raise bad_request(f"`{unsupported[0]}` is not supported (the model's own chat template renders the prompt, "
                          "and no context is kept between requests); remove it, or send the whole prompt with "
                          "`raw: true`.", param=unsupported[0])
    if req.raw and req.system is not None:
        raise bad_request("`system` has no place in a raw prompt; put it in `prompt`, or drop `raw`.", param="system")


def max_tokens(num_predict: int | None) -> int | None:
    """num_predict's count; None (its default), -1 (no limit) and -2 (fill the context) leave the
    rest of the context window."""
    return None if num_predict is None or num_predict < 0 else num_predict


def constraint(fmt: Format | None) -> StructuredOutputsParams | None:
    """`format`: "json" for any JSON object, or a JSON schema; "" or absent for none."""
    if not fmt:
        return None
    return StructuredOutputsParams(json_object=True) if fmt == "json" else StructuredOutputsParams(json=fmt)


def template_kwargs(think: bool | str | None) -> dict | None:
    """`think` as the enable_thinking variable that reasoning models' templates read; a level
    ("low", "medium", "high") also as reasoning_effort, which gpt-oss's template reads."""
    if think is None:
        return None
    if isinstance(think, str):
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": think}
