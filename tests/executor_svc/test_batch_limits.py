"""Batch limits that no flag sets take vLLM's defaults for the device and the use."""
import torch

from pagedserve.common.config import EngineConfig
from pagedserve.executor_svc.batch_limits import (CPU, GPU, LARGE_GPU, BatchDefaults, GiB, batch_defaults,
                                                  gpu_table, resolve_batch_limits)


def test_the_tables_are_vllms():
    assert gpu_table(141 * GiB, "NVIDIA H200") is LARGE_GPU
    assert gpu_table(80 * GiB, "NVIDIA A100-SXM4-80GB") is GPU
    assert gpu_table(24 * GiB, "NVIDIA L4") is GPU
    assert LARGE_GPU == (BatchDefaults(16384, 1024), BatchDefaults(8192, 1024))
    assert GPU == (BatchDefaults(8192, 256), BatchDefaults(2048, 256))
    assert batch_defaults(torch.device("cpu"), offline=True) == CPU[0] == BatchDefaults(4096, 256)
    assert batch_defaults(torch.device("cpu"), offline=False) == CPU[1] == BatchDefaults(2048, 128)


def test_defaults_fill_only_what_is_unset_and_are_clamped_as_vllm_does():
    large_offline = LARGE_GPU[0]
    resolved = resolve_batch_limits(EngineConfig(), large_offline, 8192)
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == (1024, 16384)
    given = resolve_batch_limits(EngineConfig(max_num_seqs=512, max_num_batched_tokens=4096), large_offline, 8192)
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (512, 4096)
    # A default budget holds no more than max_num_seqs full sequences; default seqs no more than it.
    short = resolve_batch_limits(EngineConfig(max_num_seqs=4), large_offline, 1000)
    assert short.max_num_batched_tokens == 4000
    tiny = resolve_batch_limits(EngineConfig(max_num_batched_tokens=100), large_offline, 8192)
    assert tiny.max_num_seqs == 100


def test_a_pooling_engines_default_budget_holds_a_whole_prompt():
    defaults = BatchDefaults(2048, 128)
    assert resolve_batch_limits(EngineConfig(), defaults, 8192, pooling=True).max_num_batched_tokens == 8192
    assert resolve_batch_limits(EngineConfig(), defaults, 512, pooling=True).max_num_batched_tokens == 2048
    # A budget the user sets stands: longer prompts are refused by the scheduler.
    given = EngineConfig(max_num_batched_tokens=1024)
    assert resolve_batch_limits(given, defaults, 8192, pooling=True).max_num_batched_tokens == 1024
