"""Engine configuration shared by the CLI, the services and the offline API (vLLM's flag names)."""
import argparse
from dataclasses import dataclass, fields


@dataclass(slots=True)
class EngineConfig:
    model: str = ""
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds every EngineConfig field except `model` as a --flag with vLLM's spelling."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--served-model-name", default=d.served_model_name)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="context length; defaults to the model's max_position_embeddings")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step (prefill chunks plus decodes)")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--num-gpu-blocks-override", type=int, default=d.num_gpu_blocks_override)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=d.kv_cache_memory_bytes,
                   help="KV cache size in bytes; on the CPU it defaults to 1 GiB")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching)
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--load-format", default=d.load_format, choices=["auto", "safetensors", "dummy"])
    g.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    g.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=d.async_scheduling,
                   help="plan the next step before the previous one's result arrives, so the GPU "
                        "does not wait for the control path")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def config_to_argv(config: EngineConfig) -> list[str]:
    """The flags that recreate `config` in a child process (the launcher's half of add_engine_args)."""
    argv: list[str] = []
    default = EngineConfig()
    for f in fields(EngineConfig):
        value = getattr(config, f.name)
        if f.name == "model" or value == getattr(default, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv
