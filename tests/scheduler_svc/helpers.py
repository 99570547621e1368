"""Builds small schedulers and requests for the scheduler tests."""
from pagedserve.common.config import EngineConfig
from pagedserve.common.plan import ExecutorInfo
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler_svc.request import Request
from pagedserve.scheduler_svc.scheduler import Scheduler

EOS = 0


def make_scheduler(num_blocks: int = 64, max_model_len: int = 256, block_size: int = 4,
                   max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                   enable_prefix_caching: bool = True, max_num_queued_reqs: int | None = None) -> Scheduler:
    config = EngineConfig(enable_prefix_caching=enable_prefix_caching, max_num_queued_reqs=max_num_queued_reqs)
    info = ExecutorInfo(num_blocks=num_blocks, block_size=block_size, dtype="none", device="none",
                        vocab_size=1000, max_model_len=max_model_len, eos_token_ids=[EOS],
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, info)


def add(s: Scheduler, seq_id: int, prompt_len: int, first_token: int = 1, **params) -> Request:
    params.setdefault("max_tokens", 100)
    request = Request(seq_id, f"r{seq_id}", list(range(first_token, first_token + prompt_len)),
                      SamplingParams(**params))
    s.add(request)
    return request
