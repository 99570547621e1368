"""A request's scheduling state, and what the scheduler reports for it after each step."""
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

import msgspec

from pagedserve.common.plan import NewRequest, StepResult
from pagedserve.common.pooling_params import PoolingParams
from pagedserve.common.sampling_params import SamplingParams


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
    status: RequestStatus = RequestStatus.WAITING
    # The prompt, then every sampled token.
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    # Advanced when a step is planned, not when its result arrives: at len(token_ids) + k while k
    # planned steps that sample have not reported their token (the executor feeds each to the
    # next step from its own copy).
    num_computed_tokens: int = 0
    # How many leading blocks are registered in the prefix cache.
    num_registered_blocks: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Mixed into the prefix cache's hash of block 0: only requests with the same salt share blocks.
    cache_salt: str = ""
    # Chained hashes of the full blocks of token_ids (prefix caching only).
    block_hashes: list[bytes] = field(default_factory=list)
    # Set by Scheduler.add: the token ids that stop this request (stop_token_ids, plus EOS unless
    # ignore_eos), and the length at which it stops (max_tokens, max_model_len, KV cache size).
    stop_ids: frozenset[int] = field(init=False)
    max_num_tokens: int = field(init=False)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_token_id: int | None = None
    # With prompt_logprobs: those received so far (token 1 on), and whether they went out.
    prompt_logprobs: list["TokenLogprobs"] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Set: a pooling request (prefill only), which ends with its pooled data instead of tokens.
    pooling: PoolingParams | None = None
    token_type_ids: list[int] = field(default_factory=list)
    # vLLM's priority (lower runs first, under --scheduling-policy priority), and whether this is
    # batch work, which runs in what interactive requests leave (scheduler_svc/policy.py).
    priority: int = 0
    background: bool = False
    # Set by Scheduler.add: the order of arrival, which breaks priority ties.
    arrival: int = 0
    # Its LoRA adapter (one of the executor's lora_names); empty: the base model.
    lora_name: str = ""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def set_stop_conditions(self, eos_token_ids: frozenset[int], max_len: int) -> None:
        """Sets stop_ids and max_num_tokens; max_len is the longest sequence the engine holds."""
        params = self.sampling
        self.stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids |= eos_token_ids
        self.max_num_tokens = max_len
        if self.pooling is not None:
            # Computed whole at admission, so the scheduler never plans it again.
            self.max_num_tokens = self.num_prompt_tokens
        elif params.max_tokens is not None:
            self.max_num_tokens = min(self.num_prompt_tokens + params.max_tokens, max_len)

    def min_tokens_mask_ids(self) -> list[int]:
        """What the executor masks until min_tokens: the stop ids, which need not travel without it."""
        return sorted(self.stop_ids) if self.sampling.min_tokens else []

    def new_request(self, num_cached: int, num_scheduled: int) -> NewRequest:
        """The plan's entry that admits this request, its first `num_cached` tokens cached."""
        return NewRequest(self.seq_id, list(self.token_ids), num_cached, num_scheduled, list(self.block_ids),
                          self.sampling, self.num_prompt_tokens, self.min_tokens_mask_ids(), self.pooling,
                          self.token_type_ids, self.lora_name)

    @property
    def prefix_salt(self) -> str:
        """What the prefix cache's hash mixes in: the cache_salt, and the adapter, whose KV differs
        from the base model's for the same tokens."""
        return f"{self.cache_salt}\0lora:{self.lora_name}" if self.lora_name else self.cache_salt


def drop_deferred(requests: dict[int, Request], result: StepResult) -> tuple[list[int], list[int]]:
    """The step's tokens but those of requests that sampled before their grammar was ready, whose
    last position is planned again (the executor rolled it back as well)."""
    deferred = set(result.deferred)
    for seq_id in deferred:
        request = requests.get(seq_id)
        if request is not None and request.status is RequestStatus.RUNNING:
            request.num_computed_tokens -= 1
    kept = [i for i, seq_id in enumerate(result.seq_ids) if seq_id not in deferred]
    return [result.seq_ids[i] for i in kept], [result.token_ids[i] for i in kept]


class TokenLogprobs(msgspec.Struct, gc=False):
    """One sampled token's log probability and rank (1 = most likely), and the top tokens'."""
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


# A msgspec Struct rather than a dataclass: built in C at half the cost, and untracked by the garbage
# collector; update() makes one per running request per step. It holds no reference cycles.
class RequestDelta(msgspec.Struct, gc=False):
    seq_id: int
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_token_id: int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    # One per new token when the request asked for logprobs.
    logprobs: list[TokenLogprobs] | None = None
    # With prompt_logprobs, on the first output: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # When the executor failed the request (finish_reason "error"): the gRPC status code and why.
    error_code: int = 0
    error: str | None = None
    # A pooling request's result: its embedding or its scores, one per label.
    pooled: list[float] | None = None


def lora_adapters(requests: Iterable[Request]) -> list[str]:
    """The LoRA adapters `requests` run with, each once, sorted (vLLM's lora_requests_info labels)."""
    return sorted({r.lora_name for r in requests if r.lora_name})
