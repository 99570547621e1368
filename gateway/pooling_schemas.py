"""Request and response bodies of the pooling routes: OpenAI's /v1/embeddings, Jina's and Cohere's
rerank (v1 and v2), and vLLM's /score."""
from typing import Literal

from msgspec import Struct

from pagedserve.gateway.schemas import Usage


class EmbeddingRequest(Struct, kw_only=True):
    # A string, a list of strings, a list of token ids or a list of lists of token ids (checked
    # after decoding: msgspec takes one array type per union).
    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: keep the last N tokens of each input (-1: the model's limit).
    truncate_prompt_tokens: int | None = None
    # vLLM's: None = the model's default (its sentence-transformers Normalize module).
    normalize: bool | None = None
    add_special_tokens: bool = True


class Embedding(Struct):
    index: int
    # A list of floats, or with encoding_format "base64" their little-endian float32 bytes in base64.
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct):
    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
    object: str = "list"


class RerankDocument(Struct):
    text: str


class RerankRequest(Struct, kw_only=True):
    """Jina's and Cohere's rerank body, v1 and v2 (whose documents are strings only)."""
    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    # None or 0: every document.
    top_n: int | None = None
    # None: the route's default (v1: true, as Jina and vLLM answer; v2: false, as Cohere's v2 has none).
    return_documents: bool | None = None
    # vLLM's: apply the classifier's sigmoid (None: yes).
    use_activation: bool | None = None


class RerankResult(Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ApiVersion(Struct, frozen=True):
    version: str = "2"


class BilledUnits(Struct):
    # Cohere bills a rerank of up to 100 documents as one search unit.
    search_units: int


class MetaTokens(Struct):
    input_tokens: int
    output_tokens: int = 0


class RerankMeta(Struct):
    billed_units: BilledUnits
    tokens: MetaTokens
    api_version: ApiVersion = ApiVersion()


class RerankV2Response(Struct):
    """Cohere's v2 shape (id, results, meta), plus vLLM's model and usage."""
    id: str
    results: list[RerankResult]
    meta: RerankMeta
    model: str
    usage: RerankUsage


class ClassificationRequest(Struct, kw_only=True):
    """vLLM's /classify: as /v1/embeddings takes `input`."""
    input: str | list[str | int | list[int]]
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    use_activation: bool | None = None


class ClassificationData(Struct):
    index: int
    # The most probable class's name (config.json's id2label, else LABEL_i as transformers names it).
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: Usage
    object: str = "list"


class ScoreRequest(Struct, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    use_activation: bool | None = None


class ScoreData(Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage
    object: str = "list"
