"""Tensor parallelism's process group and collectives: which rank this process is, what shapes
it holds, and the all-reduce / all-gather / broadcast the sharded layers and the sampler need.

A GPU rank runs its collectives over NCCL (captured by CUDA graphs like any kernel) and sends
the step plans over a gloo group on the CPU; on the CPU one gloo group carries both."""
import dataclasses
import math
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.common.cpus import usable_cpus
from pagedserve.executor_svc.model_config import ModelConfig

# torch 2.13 renamed all_gather_into_tensor (which it deprecates) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(slots=True)
class TensorParallel:
    """This process's place in a group of `size` ranks: the sharded layers take their slice of
    each weight by `rank`; `group` is None for a model that is built and loaded but not run."""
    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[N, V / size] on each rank -> [N, V], the ranks' columns side by side."""
        rows, columns = x.shape
        out = torch.empty((self.size * rows, columns), dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous(), group=self.group)
        return out.view(self.size, rows, columns).permute(1, 0, 2).reshape(rows, -1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        dist.broadcast(x, src=0, group=self.group)
        return x

    def min(self, value: int) -> int:
        """The least of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def send(self, message: object) -> None:
        """Rank 0: hands `message` to every other rank's `receive`."""
        dist.broadcast_object_list([message], src=0, group=self.cpu_group)

    def receive(self) -> object:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


# config.json's keys of the expert widths a rank holds its share of.
MOE_SIZES = {"moe_intermediate_size": "expert intermediate size",
             "shared_expert_intermediate_size": "shared expert intermediate size"}


def shard_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The shapes one of `tp_size` ranks holds: its share of the attention heads, KV heads, MLP
    width and vocabulary (a mixture of experts divides its own widths: layers.moe.moe_shape).
    Raises a one-line ValueError naming what does not divide."""
    if tp_size == 1:
        return config
    sizes = {"attention heads": config.num_attention_heads, "KV heads": config.num_key_value_heads,
             "intermediate size": config.intermediate_size, "vocabulary size": config.vocab_size}
    hf = config.hf_config
    sizes.update({name: hf[key] for key, name in MOE_SIZES.items() if hf.get(key)})
    wrong = [f"{name} {n}" for name, n in sizes.items() if n % tp_size]
    if wrong:
        common = math.gcd(*sizes.values())
        works = [str(d) for d in range(1, common + 1) if common % d == 0]
        raise ValueError(f"--tensor-parallel-size {tp_size} does not divide the model's "
                         f"{' and '.join(wrong)}; use -tp {', '.join(works)}")
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // tp_size,
        num_key_value_heads=config.num_key_value_heads // tp_size,
        intermediate_size=config.intermediate_size // tp_size,
        vocab_size=config.vocab_size // tp_size)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Rank r runs on cuda:r; CPU ranks share the host."""
    if device.type != "cuda":
        return device
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_group(rank: int, size: int, device: torch.device, init_method: str = "env://") -> TensorParallel:
    """Joins the group that rank 0 sets up at `init_method` (the other ranks find it in
    MASTER_ADDR and MASTER_PORT)."""
    if device.type == "cuda":
        # NVLink multicast (NVLS) is off on the machines we run on; NCCL must not try it.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        dist.init_process_group("nccl", init_method, rank=rank, world_size=size, device_id=device)
        return TensorParallel(rank, size, dist.group.WORLD, dist.new_group(backend="gloo"))
    # The ranks share the host's cores; more threads than cores would spin against each other.
    torch.set_num_threads(max(1, usable_cpus() // size))
    dist.init_process_group("gloo", init_method, rank=rank, world_size=size)
    return TensorParallel(rank, size, dist.group.WORLD, dist.group.WORLD)
