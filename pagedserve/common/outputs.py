"""What the offline API returns, with vLLM's names."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """A token's log probability under the model's raw logits, its rank (1 = most likely) and text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # With SamplingParams.logprobs: per output token, the sampled token's and the top tokens'.
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then each one's and the
    # top tokens' (as for outputs).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class ClassificationOutput:
    """One probability (or raw score, with activation off) per label."""
    probs: list[float]


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class PoolingRequestOutput:
    """What LLM.embed, .classify and .score return per input, with vLLM's names."""
    request_id: str
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


# vLLM's names of the one class above, by the output it holds.
EmbeddingRequestOutput = ClassificationRequestOutput = ScoringRequestOutput = PoolingRequestOutput


@dataclass(slots=True)
class BeamSearchSequence:
    """One of LLM.beam_search's continuations, with vLLM's names: every token (prompt first), per
    output token its round's logprobs (as CompletionOutput.logprobs), their sum, the output's text
    (a final end of text left out unless include_stop_str_in_output; None without a tokenizer) and
    why it ended ("stop": the end of text, "length": max_tokens)."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    text: str | None
    finish_reason: str


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's beam_width best continuations, best first."""
    sequences: list[BeamSearchSequence]
