"""The paged KV cache: how many blocks fit, and one allocation handed out as per-layer views."""
from collections.abc import Callable

import torch

from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.common.config import EngineConfig
from pagedserve.common.log import get_logger
from pagedserve.kernels.reference import FP8_DTYPE

log = get_logger(__name__)

# One layer's (k_cache, v_cache).
KVCache = tuple[torch.Tensor, torch.Tensor]

GiB = 1 << 30
CPU_DEFAULT_BYTES = GiB


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: auto stores the model dtype, fp8 float8_e4m3fn (half the bytes of bf16)."""
    return FP8_DTYPE if kv_cache_dtype == "fp8" else model_dtype


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens across every layer."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return (2 * model.num_hidden_layers * block_size * model.num_key_value_heads * model.head_dim
            * element_size)


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[KVCache]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""
    # Zeroed: a kernel that loads a masked-off slot then never sees NaN garbage, and on the CPU
    # writing every page commits the memory now (about a second per GiB), so the resident size
    # right after start-up is the steady state rather than growing as serving first touches blocks.
    cache = torch.zeros(model.num_hidden_layers, 2, num_blocks, block_size, model.num_key_value_heads,
                        model.head_dim, dtype=dtype, device=device)
    return [(layer[0], layer[1]) for layer in cache]


def determine_num_blocks(config: EngineConfig, block_bytes: int, max_model_len: int,
                         device: torch.device, measure_peak_bytes: Callable[[], int],
                         kv_dtype: torch.dtype) -> int:
    """--num-gpu-blocks-override, else --kv-cache-memory-bytes, else a CPU default budget, else
    what --gpu-memory-utilization leaves after a profiling forward (`measure_peak_bytes`). A budget
    is capped at what max_num_seqs requests of max_model_len tokens can use: a small model would
    otherwise get millions of blocks that the scheduler tracks one by one for nothing."""
    if config.num_gpu_blocks_override is not None:
        num_blocks, source = config.num_gpu_blocks_override, "override"
    elif config.kv_cache_memory_bytes is not None:
        num_blocks, source = config.kv_cache_memory_bytes // block_bytes, "kv_cache_memory_bytes"
    else:
        if device.type == "cpu":
            budget, source = CPU_DEFAULT_BYTES, "cpu_default"
        else:
            total = torch.cuda.mem_get_info(device)[1]
            peak = measure_peak_bytes()
            budget, source = int(total * config.gpu_memory_utilization - peak), "profile"
            log.info("memory_profiled", total_gib=round(total / GiB, 2), peak_gib=round(peak / GiB, 2),
                     gpu_memory_utilization=config.gpu_memory_utilization)
        most_tokens = config.max_num_seqs * max_model_len
        num_blocks = min(budget // block_bytes, -(-most_tokens // config.block_size) + 1)
    _check_fits(num_blocks, config.block_size, max_model_len, block_bytes)
    tokens = num_blocks * config.block_size
    # vLLM's "maximum concurrency": requests of max_model_len tokens that fit at once.
    log.info("kv_cache_sized", source=source, kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
             num_blocks=num_blocks, tokens=tokens,
             gib=round(num_blocks * block_bytes / GiB, 3), max_model_len=max_model_len,
             max_concurrency=round(tokens / max_model_len, 2))
    return num_blocks


def _check_fits(num_blocks: int, block_size: int, max_model_len: int, block_bytes: int) -> None:
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache holds {max(num_blocks, 0)} blocks ({max(num_blocks, 0) * block_size} tokens) "
            f"but one request of --max-model-len {max_model_len} needs {needed} blocks "
            f"({needed * block_bytes / GiB:.2f} GiB); lower --max-model-len, or raise "
            "--gpu-memory-utilization / --kv-cache-memory-bytes / --num-gpu-blocks-override")
