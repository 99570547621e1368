"""An Ollama /api/chat or /api/generate request in chat's terms: messages, tool calls with object
arguments, options as sampling fields, format as a constraint, think as enable_thinking; an
/api/embed or /api/embeddings request as the embeddings routes' inputs and pooling parameters."""
from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.ollama_schemas import Format, GenerateRequest, Message
from pagedserve.gateway.pooling_inputs import EmbedInputs
from pagedserve.gateway.schemas import ChatMessage, FunctionCallIn, ToolCallIn
from pagedserve.v1 import engine_pb2 as pb


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


def embed_inputs(given: list[str], truncate: bool, max_model_len: int) -> EmbedInputs:
    """/api/embed's inputs: with `truncate`, cut to the context from their end, as Ollama cuts them."""
    return EmbedInputs(given, max_model_len if truncate else None, keep_first=True,
                       too_long="Shorten it, or leave `truncate` true (its default) to keep its first tokens.")


def prompt_input(prompt: str) -> EmbedInputs:
    """/api/embeddings' prompt, never cut (Ollama's answers an error when it is too long)."""
    return EmbedInputs([prompt], None, keep_first=True,
                       too_long="Shorten it, or send it as `input` to /api/embed, which cuts it to fit.")


def embed_params(dimensions: int, embedding_size: int) -> pb.PoolingParams:
    """Ollama's embedding: normalised, and cut to `dimensions` (then normalised again) when that is
    smaller than the model's, whether or not the model declares Matryoshka sizes (which vLLM's
    `dimensions` requires)."""
    return pb.PoolingParams(task="embed", normalize=True, dimensions=dimensions if dimensions < embedding_size else 0)
