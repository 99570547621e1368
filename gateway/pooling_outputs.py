"""Pooled data turned into what the pooling responses carry."""
import base64
import math
import struct
from operator import mul

from pagedserve.gateway.pooling_schemas import RerankDocument, RerankResult


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or for "base64" its little-endian float32 bytes in base64 (what the
    openai SDK asks for by default and decodes with numpy's frombuffer(dtype="float32"))."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def cosine(a: list[float], b: list[float]) -> float:
    """Cosine similarity, 0 for a zero vector (a bi-encoder's score, as vLLM computes it)."""
    norms = math.sqrt(sum(map(mul, a, a))) * math.sqrt(sum(map(mul, b, b)))
    return sum(map(mul, a, b)) / norms if norms else 0.0


def cosines(pairs: list[tuple[str, str]], vectors: dict[str, list[float]]) -> list[float]:
    """The cosine of each pair's two texts, by their embeddings in `vectors`."""
    return [cosine(vectors[first], vectors[second]) for first, second in pairs]


def ranked(scores: list[float], documents: list[str], top_n: int | None,
           return_documents: bool) -> list[RerankResult]:
    """The documents by relevance_score, highest first (ties in their order), the top_n of them
    (None or 0: all), each with its index and, if asked, its text."""
    results = [RerankResult(i, score, RerankDocument(documents[i]) if return_documents else None)
               for i, score in enumerate(scores)]
    results.sort(key=lambda r: r.relevance_score, reverse=True)
    return results[:top_n] if top_n else results
