"""Builds small schedulers and requests for the scheduler tests."""
from pagedserve.common.config import EngineConfig
from pagedserve.common.plan import ExecutorInfo, StepPlan, StepResult
from pagedserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedserve.scheduler_svc.request import Request, RequestDelta
from pagedserve.scheduler_svc.scheduler import Scheduler

EOS = 0


def make_scheduler(num_blocks: int = 64, max_model_len: int = 256, block_size: int = 4,
                   max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                   enable_prefix_caching: bool = True, max_num_queued_reqs: int | None = None,
                   scheduling_policy: str = "fcfs", mixed_graph_tokens: int = 0,
                   kv_cache_dtype: str = "bfloat16", max_logprobs: int = MAX_LOGPROBS,
                   long_prefill_token_threshold: int = 0, lora_names: tuple[str, ...] = (),
                   max_loras: int = 0, offline: bool = False) -> Scheduler:
    config = EngineConfig(enable_prefix_caching=enable_prefix_caching, max_num_queued_reqs=max_num_queued_reqs,
                          scheduling_policy=scheduling_policy, long_prefill_token_threshold=long_prefill_token_threshold)
    info = ExecutorInfo(num_blocks=num_blocks, block_size=block_size, dtype="none", device="none",
                        vocab_size=1000, max_model_len=max_model_len, eos_token_ids=[EOS],
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        mixed_graph_tokens=mixed_graph_tokens, kv_cache_dtype=kv_cache_dtype,
                        max_logprobs=max_logprobs, lora_names=list(lora_names), max_loras=max_loras)
    return Scheduler(config, info, offline=offline)


def add(s: Scheduler, seq_id: int, prompt_len: int, first_token: int = 1, priority: int = 0,
        background: bool = False, lora_name: str = "", **params) -> Request:
    params.setdefault("max_tokens", 100)
    request = Request(seq_id, f"r{seq_id}", list(range(first_token, first_token + prompt_len)),
                      SamplingParams(**params), priority=priority, background=background, lora_name=lora_name)
    s.add(request)
    return request


def step(s: Scheduler, tokens: dict[int, int] | None = None) -> tuple[StepPlan, list[RequestDelta]]:
    """One step with an executor that samples tokens[seq_id] (default 7) for each completed request."""
    plan = s.schedule()
    # Planning advanced each request: those now computed past their known tokens sample.
    sampled = [r.seq_id for r in plan.new_requests + plan.continuing
               if s.requests[r.seq_id].num_computed_tokens >= len(s.requests[r.seq_id].token_ids)]
    tokens = tokens or {}
    result = StepResult(plan.step_id, sampled, [tokens.get(seq_id, 7) for seq_id in sampled])
    return plan, s.update(plan, result)


def scheduled(plan: StepPlan) -> dict[int, int]:
    return {r.seq_id: r.num_scheduled_tokens for r in plan.new_requests + plan.continuing}
