"""What travels between the scheduler and the executor: step plans (deltas) and step results."""
from dataclasses import dataclass, field

import msgspec

from pagedserve.common.pooling_params import PoolingParams, pooling_from_proto, pooling_to_proto
from pagedserve.common.sampling_params import MAX_LOGPROBS, SamplingParams, sampling_from_proto, sampling_to_proto
from pagedserve.v1 import executor_pb2 as pb

# Steps planned ahead of results: with two, the executor prepares and launches the next step
# while the device still runs the previous one.
MAX_STEPS_IN_FLIGHT = 2


@dataclass(slots=True)
class NewRequest:
    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list[int]
    sampling: SamplingParams
    # token_ids[:num_prompt_tokens] is the prompt, the rest outputs sampled before a preemption;
    # None: all of token_ids is the prompt.
    num_prompt_tokens: int | None = None
    # What the sampler masks while the request has fewer than sampling.min_tokens outputs (EOS
    # unless ignore_eos, and stop_token_ids); empty without min_tokens.
    min_tokens_mask_ids: list[int] = field(default_factory=list)
    # Set: a pooling request, its whole prompt scheduled in this one step, which returns its pooled
    # data rather than a token; token_type_ids: one per prompt token (empty = all zeros).
    pooling: PoolingParams | None = None
    token_type_ids: list[int] = field(default_factory=list)
    # Its LoRA adapter, one of ExecutorInfo.lora_names; empty: the base model.
    lora_name: str = ""


# A msgspec Struct rather than a dataclass: built in C at half the cost and untracked by the garbage
# collector; the scheduler makes one per running request per step, the executor decodes as many.
class ContinuingRequest(msgspec.Struct, gc=False):
    seq_id: int
    num_scheduled_tokens: int
    new_block_ids: list[int]


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    continuing: list[ContinuingRequest] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    # The scheduler's own bookkeeping, not sent: the CPU time spent planning, and whether the
    # engine sat without work just before (so the executor's idle gap was not the control path's).
    schedule_ns: int = 0
    after_pause: bool = False

    def is_empty(self) -> bool:
        return not (self.new_requests or self.continuing or self.dropped)

    @property
    def num_tokens(self) -> int:
        return (sum(r.num_scheduled_tokens for r in self.new_requests)
                + sum(r.num_scheduled_tokens for r in self.continuing))


@dataclass(slots=True)
class StepLogprobs:
    """Raw-logit log probabilities of the sampled rows that asked, packed: entry i is about
    seq_ids[rows[i]], whose num_top[i] top tokens follow the previous entries' in the top_ lists."""
    rows: list[int]
    logprobs: list[float]
    ranks: list[int]
    num_top: list[int]
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobs:
    """Log probabilities of the prompt tokens a step computed, for the requests that asked:
    seq_ids[i]'s counts[i] entries describe its prompt tokens from index starts[i] on, and follow
    the previous requests' entries in `logprobs` (whose rows are entry indices)."""
    seq_ids: list[int]
    starts: list[int]
    counts: list[int]
    logprobs: StepLogprobs


# The gRPC status codes a RequestError carries (grpc.StatusCode's numbers, fixed by the protocol).
INVALID_ARGUMENT, FAILED_PRECONDITION = 3, 9


@dataclass(slots=True)
class RequestError:
    """A request the executor failed on its own, the rest of its step going on."""
    seq_id: int
    code: int
    message: str


@dataclass(slots=True)
class StepResult:
    step_id: int
    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # The step's time on the device, and how long the device sat idle between the previous
    # step's end and this one's start (CUDA events on a GPU): what the control path costs it.
    forward_ns: int = 0
    idle_ns: int = 0
    logprobs: StepLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    errors: list[RequestError] = field(default_factory=list)
    # Requests that sampled before their grammar was ready: their tokens here are void, and the
    # executor computes their last position again in the next step that schedules them.
    deferred: list[int] = field(default_factory=list)
    # Pooling requests whose last prompt token this step computed: pooled_seq_ids[i]'s
    # pooled_sizes[i] values follow the previous requests' in pooled_data.
    pooled_seq_ids: list[int] = field(default_factory=list)
    pooled_sizes: list[int] = field(default_factory=list)
    pooled_data: list[float] = field(default_factory=list)

    def pooled(self) -> dict[int, list[float]]:
        """Each pooled request's data by seq_id."""
        out, end = {}, 0
        for seq_id, size in zip(self.pooled_seq_ids, self.pooled_sizes):
            out[seq_id], end = self.pooled_data[end:end + size], end + size
        return out


@dataclass(slots=True)
class PoolingInfo:
    """What a pooling engine serves (ModelInfo's fields of the same names)."""
    tasks: list[str] = field(default_factory=list)
    embedding_size: int = 0
    matryoshka_dimensions: list[int] = field(default_factory=list)
    is_matryoshka: bool = False
    num_labels: int = 0
    default_prompt: str = ""
    labels: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ExecutorInfo:
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    # The batch limits the executor sized its buffers and CUDA graphs for; the scheduler's.
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float = 0.0
    runner: str = "generate"
    pooling: PoolingInfo = field(default_factory=PoolingInfo)
    # The most tokens of a step with prompt chunks that the executor replays as a CUDA graph
    # (0: such steps run eagerly); the scheduler sizes prompt chunks beside decode rows by it.
    mixed_graph_tokens: int = 0
    # The KV cache's element type as torch names it ("" from an executor that does not say).
    kv_cache_dtype: str = ""
    # The most top logprobs a request may ask for per token (--max-logprobs, -1 resolved to the
    # vocabulary's size): what the executor sized its logprob buffers for.
    max_logprobs: int = MAX_LOGPROBS
    # The LoRA adapters served (--lora-modules names), and how many of them one step may use.
    lora_names: list[str] = field(default_factory=list)
    max_loras: int = 0


def plan_to_proto(plan: StepPlan) -> pb.StepPlan:
    m = pb.StepPlan(step_id=plan.step_id, dropped=plan.dropped)
    for r in plan.new_requests:
        m.new_requests.add(seq_id=r.seq_id, token_ids=r.token_ids, num_computed_tokens=r.num_computed_tokens,
                           num_scheduled_tokens=r.num_scheduled_tokens, block_ids=r.block_ids,
                           sampling=sampling_to_proto(r.sampling), num_prompt_tokens=r.num_prompt_tokens,
                           min_tokens_mask_ids=r.min_tokens_mask_ids, token_type_ids=r.token_type_ids,
                           pooling=None if r.pooling is None else pooling_to_proto(r.pooling), lora_name=r.lora_name)
    # Runs once per running request per step: add() in place is 2x cheaper than building each
    # message and copying it in, and an empty repeated field passed as a keyword costs as much again.
    add = m.continuing.add
    for r in plan.continuing:
        if r.new_block_ids:
            add(seq_id=r.seq_id, num_scheduled_tokens=r.num_scheduled_tokens, new_block_ids=r.new_block_ids)
        else:
            add(seq_id=r.seq_id, num_scheduled_tokens=r.num_scheduled_tokens)
    return m


def plan_from_proto(m: pb.StepPlan) -> StepPlan:
    # Slicing copies a repeated field to a list in C; list() iterates it element by element.
    return StepPlan(
        step_id=m.step_id,
        new_requests=[NewRequest(r.seq_id, r.token_ids[:], r.num_computed_tokens, r.num_scheduled_tokens,
                                 r.block_ids[:], sampling_from_proto(r.sampling),
                                 r.num_prompt_tokens if r.HasField("num_prompt_tokens") else None,
                                 r.min_tokens_mask_ids[:],
                                 pooling_from_proto(r.pooling) if r.HasField("pooling") else None,
                                 r.token_type_ids[:], r.lora_name)
                      for r in m.new_requests],
        continuing=[ContinuingRequest(r.seq_id, r.num_scheduled_tokens, r.new_block_ids[:])
                    for r in m.continuing],
        dropped=m.dropped[:])


def result_to_proto(r: StepResult) -> pb.StepResult:
    prompt = r.prompt_logprobs
    m = pb.StepResult(step_id=r.step_id, seq_ids=r.seq_ids, token_ids=r.token_ids,
                      forward_ns=r.forward_ns, idle_ns=r.idle_ns,
                      logprobs=None if r.logprobs is None else logprobs_to_proto(r.logprobs),
                      prompt_logprobs=None if prompt is None else pb.PromptLogprobs(
                          seq_ids=prompt.seq_ids, starts=prompt.starts, counts=prompt.counts,
                          logprobs=logprobs_to_proto(prompt.logprobs)), deferred=r.deferred,
                      pooled_seq_ids=r.pooled_seq_ids, pooled_sizes=r.pooled_sizes,
                      pooled_data=r.pooled_data)
    for e in r.errors:
        m.errors.add(seq_id=e.seq_id, code=e.code, message=e.message)
    return m


def result_from_proto(m: pb.StepResult) -> StepResult:
    prompt = None
    if m.HasField("prompt_logprobs"):
        p = m.prompt_logprobs
        prompt = PromptLogprobs(p.seq_ids[:], p.starts[:], p.counts[:], logprobs_from_proto(p.logprobs))
    return StepResult(m.step_id, list(m.seq_ids), list(m.token_ids), m.forward_ns, m.idle_ns,
                      logprobs_from_proto(m.logprobs) if m.HasField("logprobs") else None, prompt,
                      [RequestError(e.seq_id, e.code, e.message) for e in m.errors], m.deferred[:],
                      m.pooled_seq_ids[:], m.pooled_sizes[:], m.pooled_data[:])


def logprobs_to_proto(lp: StepLogprobs) -> pb.StepLogprobs:
    return pb.StepLogprobs(rows=lp.rows, logprobs=lp.logprobs, ranks=lp.ranks, num_top=lp.num_top,
                           top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs)


def logprobs_from_proto(m: pb.StepLogprobs) -> StepLogprobs:
    return StepLogprobs(m.rows[:], m.logprobs[:], m.ranks[:], m.num_top[:], m.top_token_ids[:],
                        m.top_logprobs[:])


def info_to_proto(i: ExecutorInfo) -> pb.ExecutorInfo:
    p = i.pooling
    return pb.ExecutorInfo(num_blocks=i.num_blocks, block_size=i.block_size, dtype=i.dtype,
                           device=i.device, vocab_size=i.vocab_size, max_model_len=i.max_model_len,
                           eos_token_ids=i.eos_token_ids, max_num_seqs=i.max_num_seqs,
                           max_num_batched_tokens=i.max_num_batched_tokens,
                           gpu_memory_utilization=i.gpu_memory_utilization, runner=i.runner,
                           pooling_tasks=p.tasks, embedding_size=p.embedding_size,
                           matryoshka_dimensions=p.matryoshka_dimensions, is_matryoshka=p.is_matryoshka,
                           num_labels=p.num_labels, default_prompt=p.default_prompt,
                           mixed_graph_tokens=i.mixed_graph_tokens, labels=p.labels,
                           kv_cache_dtype=i.kv_cache_dtype, max_logprobs=i.max_logprobs, lora_names=i.lora_names,
                           max_loras=i.max_loras)


def info_from_proto(m: pb.ExecutorInfo) -> ExecutorInfo:
    pooling = PoolingInfo(list(m.pooling_tasks), m.embedding_size, list(m.matryoshka_dimensions),
                          m.is_matryoshka, m.num_labels, m.default_prompt, list(m.labels))
    return ExecutorInfo(m.num_blocks, m.block_size, m.dtype, m.device, m.vocab_size,
                        m.max_model_len, list(m.eos_token_ids), m.max_num_seqs,
                        m.max_num_batched_tokens, m.gpu_memory_utilization, m.runner or "generate", pooling,
                        m.mixed_graph_tokens, m.kv_cache_dtype, m.max_logprobs, list(m.lora_names), m.max_loras)
