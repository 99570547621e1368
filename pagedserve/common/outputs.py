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
