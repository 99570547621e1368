"""GPU memory profiling: what the model needs beside the KV cache, measured by running the
largest step the engine will run, so that kv_cache.determine_num_blocks can give the KV cache the
rest of the --gpu-memory-utilization budget."""
from typing import TYPE_CHECKING

import torch

from pagedserve.executor_svc.kv_cache import allocate_kv_cache, bytes_per_block
from pagedserve.common.log import get_logger

if TYPE_CHECKING:
    from pagedserve.executor_svc.worker import Worker

log = get_logger(__name__)


def used_bytes(device: torch.device) -> int:
    """Device memory in use now, by every process on the device."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def profile_peak_bytes(worker: "Worker") -> int:
    """The device memory in use at the peak of the largest step (weights included, its scratch
    KV cache not), plus what the CUDA graphs will hold and what lies outside torch's allocator
    since the worker started (worker.used_at_start: other engines on a shared GPU, as with
    `serve --also-serve`, are no part of this one's --gpu-memory-utilization share)."""
    device, config, runner = worker.device, worker.config, worker.runner
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    scratch_tokens = min(config.max_num_batched_tokens, worker.max_model_len)
    scratch_bytes = (-(-scratch_tokens // worker.block_size)
                     * bytes_per_block(worker.rank_config, worker.block_size, worker.kv_dtype))
    runner.dummy_run(config.max_num_batched_tokens, config.max_num_seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    graph_bytes = _graph_bytes(worker) if runner.shapes.decode else 0
    free, total = torch.cuda.mem_get_info(device)
    # cuBLAS workspaces and other memory that torch's allocator doesn't see.
    # Never below 0: another engine may have freed memory meanwhile.
    outside_torch = max(0, total - free - worker.used_at_start - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    log.info("profile_run", weights_gib=round(before / 2**30, 2),
             activations_gib=round((peak - before - scratch_bytes) / 2**30, 2),
             cuda_graphs_reserved_gib=round(graph_bytes / 2**30, 2),
             outside_torch_gib=round(outside_torch / 2**30, 2))
    return peak - scratch_bytes + graph_bytes + outside_torch


def _graph_bytes(worker: "Worker") -> int:
    """What the CUDA graphs will hold beside the eager peak: the activations of the largest decode
    or mixed step (all graphs share one pool, the largest captured first) and every graph's
    output."""
    device, runner = worker.device, worker.runner
    scratch = allocate_kv_cache(worker.rank_config, 1, worker.block_size, worker.kv_dtype, device)
    activations = 0
    for largest in runner.shapes.largest():
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        runner.graphs.fill_padding(largest)
        runner.graphs.forward(largest, scratch)
        torch.cuda.synchronize(device)
        activations = max(activations, torch.cuda.max_memory_allocated(device) - before)
    tokens = sum(shape.num_tokens for shape in runner.shapes.all())
    outputs = tokens * worker.model_config.hidden_size * worker.dtype.itemsize
    return activations + outputs
