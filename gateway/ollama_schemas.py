"""Ollama API request and response bodies as msgspec Structs (ollama/ollama docs/api.md)."""
from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from pagedserve.common.sampling_params import MAX_LOGPROBS
from pagedserve.gateway.schemas import MAX_MESSAGES, MAX_STOP_STRINGS, Tool


class Options(Struct, kw_only=True):
    """The Modelfile parameters a request may set; the rest (num_ctx, num_gpu, mirostat, ...) configure
    Ollama's own runner and are ignored, as Ollama ignores options it does not know."""
    num_predict: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class FunctionCall(Struct):
    name: str
    arguments: dict[str, Any]


class ToolCall(Struct):
    function: FunctionCall


class Message(Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class MessageOut(Struct, omit_defaults=True):
    role: str
    content: str
    thinking: str | UnsetType = UNSET
    tool_calls: list[ToolCall] | UnsetType = UNSET


# Ollama's "format": "json", or a JSON schema; "" is none.
Format = Literal["", "json"] | dict


class GenerationFields(Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    format: Format | None = None
    options: Options | None = None
    stream: bool = True
    # true/false, or a level ("low", "medium", "high") that models with levels read.
    think: bool | str | None = None
    keep_alive: str | float | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] = 0


class ChatRequest(GenerationFields, kw_only=True):
    messages: Annotated[list[Message], Meta(max_length=MAX_MESSAGES)] = []
    tools: list[Tool] | None = None
    # Ollama's: a chat too long for the context loses its oldest messages (false: an error).
    truncate: bool = True


class GenerateRequest(GenerationFields, kw_only=True):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedRequest(Struct, kw_only=True):
    """/api/embed's body. `truncate` false: a 400 for an input past the context, which true cuts to fit
    (its end goes). `dimensions` cuts each embedding, then normalises it again; 0 is the full size."""
    model: Annotated[str, Meta(min_length=1)]
    input: str | list[str] | None = None
    truncate: bool = True
    dimensions: Annotated[int, Meta(ge=0)] = 0
    options: Options | None = None
    keep_alive: str | float | None = None


class EmbedResponse(Struct, kw_only=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0


class EmbeddingsRequest(Struct, kw_only=True):
    """The legacy /api/embeddings' body: one prompt, embedded as the model gives it (not normalised by
    the route, as Ollama's), never truncated."""
    model: Annotated[str, Meta(min_length=1)]
    prompt: str = ""
    options: Options | None = None
    keep_alive: str | float | None = None


class EmbeddingsResponse(Struct):
    embedding: list[float]


class ModelRequest(Struct, kw_only=True):
    """/api/show's body; older clients send `name`."""
    model: str | None = None
    name: str | None = None
    verbose: bool = False


class TokenLogprob(Struct):
    token: str
    logprob: float


class Logprob(Struct, omit_defaults=True):
    """A generated token's logprob, with the most likely tokens' when top_logprobs asked for them."""
    token: str
    logprob: float
    top_logprobs: list[TokenLogprob] | UnsetType = UNSET


class _Reply(Struct, kw_only=True, omit_defaults=True):
    """What every reply line holds; the last (done) adds why it ended, durations in nanoseconds and
    token counts."""
    model: str
    created_at: str
    done: bool
    done_reason: str | UnsetType = UNSET
    total_duration: int | UnsetType = UNSET
    load_duration: int | UnsetType = UNSET
    prompt_eval_count: int | UnsetType = UNSET
    prompt_eval_duration: int | UnsetType = UNSET
    eval_count: int | UnsetType = UNSET
    eval_duration: int | UnsetType = UNSET
    # With `logprobs`: those of the tokens this line brings.
    logprobs: list[Logprob] | UnsetType = UNSET


class ChatChunk(_Reply, kw_only=True, omit_defaults=True):
    message: MessageOut


class GenerateChunk(_Reply, kw_only=True, omit_defaults=True):
    response: str
    thinking: str | UnsetType = UNSET


class ModelDetails(Struct):
    parent_model: str = ""
    format: str = ""
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class ModelEntry(Struct, kw_only=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class RunningModel(ModelEntry, kw_only=True):
    expires_at: str
    size_vram: int
    context_length: int


class TagsResponse(Struct):
    models: list[ModelEntry]


class PsResponse(Struct):
    models: list[RunningModel]


class ShowResponse(Struct, kw_only=True):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class VersionResponse(Struct):
    version: str


class ErrorBody(Struct):
    error: str
