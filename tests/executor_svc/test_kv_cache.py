import subprocess
import sys

import pytest
import torch

from pagedserve.executor_svc.kv_cache import (GiB, allocate_kv_cache, bytes_per_block, determine_num_blocks,
                                              resolve_kv_cache_dtype)
from pagedserve.executor_svc.model_config import model_config_from_dict
from pagedserve.common.config import EngineConfig
from pagedserve.common.model_shapes import SHAPES

CPU = torch.device("cpu")
LLAMA_8B = model_config_from_dict(SHAPES["llama-3.1-8b"])


def never_profiled() -> int:
    raise AssertionError("the CPU path must not profile")


def test_bytes_per_block_of_llama_3_1_8b():
    # 32 layers x (K + V) x 8 kv heads x 128 dims x 2 bytes = 128 KiB per token.
    assert bytes_per_block(LLAMA_8B, 16, torch.bfloat16) == 16 * 128 * 1024


def test_override_then_bytes_then_cpu_default():
    per_block = bytes_per_block(LLAMA_8B, 16, torch.float32)

    def sized(**flags) -> int:
        limits = dict(max_num_seqs=256, max_num_batched_tokens=2048)
        return determine_num_blocks(EngineConfig(**{**limits, **flags}), per_block, 1024, CPU, never_profiled,
                                    torch.float32)

    assert sized(num_gpu_blocks_override=100, kv_cache_memory_bytes=GiB) == 100
    assert sized(kv_cache_memory_bytes=GiB) == GiB // per_block
    assert sized() == GiB // per_block
    # Two sequences of 1024 tokens need 128 blocks; one more is allowed, nothing beyond.
    assert sized(max_num_seqs=2) == 129


def test_refuses_a_cache_smaller_than_one_full_request():
    per_block = bytes_per_block(LLAMA_8B, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="needs 64 blocks.*lower --max-model-len"):
        determine_num_blocks(EngineConfig(num_gpu_blocks_override=63), per_block, 1024, CPU,
                             never_profiled, torch.bfloat16)


def test_layers_are_views_of_one_allocation():
    tiny = model_config_from_dict({**SHAPES["llama-3.1-8b"], "num_hidden_layers": 3})
    caches = allocate_kv_cache(tiny, 5, 4, torch.float16, CPU)
    assert len(caches) == 3
    k0, v2 = caches[0][0], caches[2][1]
    assert k0.shape == (5, 4, 8, 128) and k0.dtype == torch.float16
    assert k0.untyped_storage().data_ptr() == v2.untyped_storage().data_ptr()
    k0.zero_()
    v2.fill_(1.0)
    assert k0.sum() == 0 and v2.sum() == 5 * 4 * 8 * 128


# Run in a fresh process: in this one, memory that earlier tests freed may still be mapped and
# resident, and an allocation that reuses it shows no growth.
ARENA_PROBE = """
import psutil, torch
from pagedserve.common.model_shapes import SHAPES
from pagedserve.executor_svc.kv_cache import allocate_kv_cache, bytes_per_block
from pagedserve.executor_svc.model_config import model_config_from_dict
tiny = model_config_from_dict({**SHAPES["llama-3.1-8b"], "num_hidden_layers": 2})
before = psutil.Process().memory_info().rss
caches = allocate_kv_cache(tiny, 256, 16, torch.float32, torch.device("cpu"))
print(psutil.Process().memory_info().rss - before, 256 * bytes_per_block(tiny, 16, torch.float32))
"""


def test_the_cpu_arena_is_resident_as_soon_as_it_is_allocated():
    """Written once at start, so the resident size right after start-up is the steady state."""
    probe = subprocess.run([sys.executable, "-c", ARENA_PROBE], capture_output=True, text=True, check=True)
    grown, arena = map(int, probe.stdout.split())
    assert grown >= 0.9 * arena
    caches = allocate_kv_cache(LLAMA_8B, 3, 16, torch.float32, CPU)
    assert all(k.count_nonzero() == 0 and v.count_nonzero() == 0 for k, v in caches)


def test_fp8_cache_holds_twice_the_blocks_of_bf16_in_the_same_bytes():
    fp8 = resolve_kv_cache_dtype("fp8", torch.bfloat16)
    assert fp8 == torch.float8_e4m3fn and resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert bytes_per_block(LLAMA_8B, 16, fp8) * 2 == bytes_per_block(LLAMA_8B, 16, torch.bfloat16)
    config = EngineConfig(kv_cache_memory_bytes=GiB, max_num_seqs=256, max_num_batched_tokens=2048)

    def sized(dtype: torch.dtype) -> int:
        return determine_num_blocks(config, bytes_per_block(LLAMA_8B, 16, dtype), 1024, CPU,
                                    never_profiled, dtype)

    assert sized(fp8) == 2 * sized(torch.bfloat16) == 2 * 512
    k, v = allocate_kv_cache(LLAMA_8B, 3, 16, fp8, CPU)[0]
    assert k.dtype == v.dtype == fp8 and k.stride() == v.stride()
