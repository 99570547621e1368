"""max_num_seqs and max_num_batched_tokens when no flag sets them: vLLM's V1 defaults, chosen by
the device and by the use (the offline LLM or the API server), as vLLM's get_batch_defaults does."""
from dataclasses import dataclass, replace

import torch

from pagedserve.common.config import EngineConfig

GiB = 1 << 30
LARGE_GPU_BYTES = 70 * GiB


@dataclass(slots=True, frozen=True)
class BatchDefaults:
    max_num_batched_tokens: int
    max_num_seqs: int


# (offline, server). GPUs of 70 GiB or more get the large budgets, but not A100s, where vLLM
# measured a larger token budget losing throughput (vLLM PR #17885).
LARGE_GPU = (BatchDefaults(16384, 1024), BatchDefaults(8192, 1024))
GPU = (BatchDefaults(8192, 256), BatchDefaults(2048, 256))
CPU = (BatchDefaults(4096, 256), BatchDefaults(2048, 128))


def batch_defaults(device: torch.device, offline: bool) -> BatchDefaults:
    table = CPU
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        table = gpu_table(props.total_memory, props.name)
    return table[0 if offline else 1]


def gpu_table(total_memory: int, name: str) -> tuple[BatchDefaults, BatchDefaults]:
    large = total_memory >= LARGE_GPU_BYTES and "a100" not in name.lower()
    return LARGE_GPU if large else GPU


def resolve_batch_limits(config: EngineConfig, defaults: BatchDefaults, max_model_len: int,
                         pooling: bool = False) -> EngineConfig:
    """`config` with its unset limits filled in; as in vLLM, a default token budget is no more than
    max_num_seqs full-length sequences, and default max_num_seqs no more than that budget. With
    `pooling` (whose prompts are computed whole) the default budget is at least max_model_len,
    as vLLM sets it for pooling models."""
    max_num_seqs = config.max_num_seqs or defaults.max_num_seqs
    max_num_batched_tokens = config.max_num_batched_tokens or min(defaults.max_num_batched_tokens,
                                                                  max_num_seqs * max_model_len)
    if pooling and config.max_num_batched_tokens is None:
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    if config.max_num_seqs is None:
        max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
    return replace(config, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
