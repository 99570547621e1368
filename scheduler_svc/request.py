"""A request's scheduling state, and what the scheduler reports for it after each step."""
import time
from dataclasses import dataclass, field
from enum import Enum

from pagedserve.plan import SamplingOptions
from pagedserve.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of token_ids (prefix caching only).
    block_hashes: list[int] = field(default_factory=list)
    # Set by Scheduler.add: the token ids that stop this request (stop_token_ids, plus EOS unless
    # ignore_eos), and the length at which it stops (max_tokens, max_model_len, KV cache size).
    stop_ids: frozenset[int] = field(init=False)
    max_num_tokens: int = field(init=False)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_token_id: int | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def sampling_options(self) -> SamplingOptions:
        p = self.sampling
        return SamplingOptions(p.temperature, p.top_p, p.top_k, p.min_p, p.seed)


@dataclass(slots=True)
class RequestOutput:
    seq_id: int
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_token_id: int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
