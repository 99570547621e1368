"""Engine configuration shared by the CLI, the services and the offline API (vLLM's flag names).

Each flag belongs to the process that owns its fact. The executor owns the model and the KV cache:
its Describe reports the geometry that results (block size, number of blocks, dtype, context
length), and the scheduler plans with that report. The scheduler owns batching."""
import argparse
from dataclasses import dataclass, fields


@dataclass(slots=True)
class EngineConfig:
    model: str = ""
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_queued_reqs: int | None = None
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    seed: int = 0
    load_format: str = "auto"
    device: str = "auto"
    enforce_eager: bool = False
    async_scheduling: bool = True

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


SCHEDULER_FLAGS = ("served_model_name", "max_num_seqs", "max_num_queued_reqs", "max_num_batched_tokens",
                   "enable_prefix_caching", "async_scheduling")
EXECUTOR_FLAGS = ("max_model_len", "block_size", "gpu_memory_utilization", "num_gpu_blocks_override",
                  "kv_cache_memory_bytes", "dtype", "seed", "load_format", "device", "enforce_eager")
# Executor flags whose value Describe reports back; a scheduler given one checks it against that.
GEOMETRY_FLAGS = ("max_model_len", "block_size", "num_gpu_blocks_override", "dtype")


def _flag_specs() -> dict[str, dict]:
    d = EngineConfig()
    toggle = argparse.BooleanOptionalAction
    return {
        "served_model_name": dict(default=d.served_model_name),
        "max_model_len": dict(type=int, default=d.max_model_len,
                              help="context length; defaults to the model's max_position_embeddings"),
        "max_num_seqs": dict(type=int, default=d.max_num_seqs),
        "max_num_queued_reqs": dict(type=int, default=d.max_num_queued_reqs,
                                    help="requests that may wait for a running slot; past it new ones "
                                         "get 503 server_overloaded with Retry-After (default: no limit)"),
        "max_num_batched_tokens": dict(type=int, default=d.max_num_batched_tokens,
                                       help="token budget of one step (prefill chunks plus decodes)"),
        "block_size": dict(type=int, default=d.block_size),
        "gpu_memory_utilization": dict(type=float, default=d.gpu_memory_utilization),
        "num_gpu_blocks_override": dict(type=int, default=d.num_gpu_blocks_override),
        "kv_cache_memory_bytes": dict(type=int, default=d.kv_cache_memory_bytes,
                                      help="KV cache size in bytes; on the CPU it defaults to 1 GiB"),
        "enable_prefix_caching": dict(action=toggle, default=d.enable_prefix_caching),
        "dtype": dict(default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"]),
        "seed": dict(type=int, default=d.seed),
        "load_format": dict(default=d.load_format, choices=["auto", "safetensors", "dummy"]),
        "device": dict(default=d.device, help="auto, cpu or cuda"),
        "enforce_eager": dict(action="store_true", help="disable CUDA graphs"),
        "async_scheduling": dict(action=toggle, default=d.async_scheduling,
                                 help="plan the next step before the previous one's result arrives, "
                                      "so the GPU does not wait for the control path"),
    }


def add_engine_args(parser: argparse.ArgumentParser,
                    names: tuple[str, ...] = SCHEDULER_FLAGS + EXECUTOR_FLAGS) -> None:
    """Adds the named EngineConfig fields as --flags with vLLM's spelling (all of them by default)."""
    specs = _flag_specs()
    g = parser.add_argument_group("engine")
    for name in names:
        g.add_argument("--" + name.replace("_", "-"), **specs[name])


def add_geometry_checks(parser: argparse.ArgumentParser) -> None:
    """The executor's geometry flags, for a scheduler: unset by default, checked when given."""
    specs = _flag_specs()
    g = parser.add_argument_group("KV-cache geometry (the executor's; checked against its Describe)")
    for name in GEOMETRY_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), **{**specs[name], "default": None})


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None})


def config_to_argv(config: EngineConfig, names: tuple[str, ...]) -> list[str]:
    """The flags among `names` that recreate `config` in a child process."""
    argv: list[str] = []
    default = EngineConfig()
    for name in names:
        value = getattr(config, name)
        if value == getattr(default, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv
