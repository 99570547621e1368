"""Engine configuration shared by the CLI, the services and the offline API (vLLM's flag names).

Each flag belongs to the process that owns its fact. The executor owns the model, the device and
the KV cache, and so the batch limits it sizes its buffers, CUDA graphs and memory profile for:
its Describe reports the results (block size, number of blocks, dtype, context length,
max_num_seqs, max_num_batched_tokens), and the scheduler plans with that report. The scheduler
owns batching policy (scheduling policy, prefix caching, async scheduling) and the served name."""
import argparse
import difflib
import json
from dataclasses import dataclass, fields

from pagedserve.common import arg_types
from pagedserve.common.sampling_params import MAX_LOGPROBS

# vLLM's --logprobs-mode values, its default first.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(slots=True)
class EngineConfig:
    model: str = ""
    served_model_name: list[str] | None = None
    max_model_len: int | None = None
    # None: chosen by the device, as vLLM does (executor_svc/batch_limits.py).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_queued_reqs: int | None = None
    # vLLM's: fcfs (arrival order) or priority (lower `priority` first, ties by arrival).
    scheduling_policy: str = "fcfs"
    # vLLM's: the most prompt tokens one request computes in a step (0: the step's budget).
    long_prefill_token_threshold: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    seed: int = 0
    load_format: str = "auto"
    # None: the checkpoint's own (an FP8 one loads as FP8), else unquantized.
    quantization: str | None = None
    device: str = "auto"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    async_scheduling: bool = True
    disable_log_stats: bool = False
    # vLLM's: auto = pooling for an encoder, a sequence classifier or a sentence-transformers
    # directory, else generate; --task (older) picks the runner too.
    runner: str = "auto"
    task: str | None = None
    pooler_config: dict | None = None
    hf_overrides: dict | None = None
    # The most top logprobs a request may ask for per token; -1: the vocabulary's size.
    max_logprobs: int = MAX_LOGPROBS
    # vLLM's: what sampled tokens' logprobs hold (LOGPROBS_MODES).
    logprobs_mode: str = LOGPROBS_MODES[0]
    # LoRA adapters (vLLM's flags): each --lora-modules entry name=path or a JSON object with
    # "name" and "path"; max_loras of them may serve one step, each of rank max_lora_rank at most.
    enable_lora: bool = False
    lora_modules: list[str] | None = None
    max_loras: int = 1
    max_lora_rank: int = 16

    @property
    def name(self) -> str:
        """The served name that the engine reports: the first --served-model-name, else the path."""
        return self.served_model_name[0] if self.served_model_name else self.model


SCHEDULER_FLAGS = ("served_model_name", "max_num_queued_reqs", "scheduling_policy", "enable_prefix_caching",
                   "async_scheduling", "disable_log_stats", "long_prefill_token_threshold")
EXECUTOR_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                  "gpu_memory_utilization", "num_gpu_blocks_override", "kv_cache_memory_bytes", "dtype",
                  "kv_cache_dtype", "seed", "load_format", "quantization", "device", "enforce_eager",
                  "tensor_parallel_size", "runner", "task", "pooler_config", "hf_overrides", "max_logprobs",
                  "logprobs_mode", "enable_lora", "lora_modules", "max_loras", "max_lora_rank")
# Executor flags whose value Describe reports back; a scheduler given one checks it against that.
GEOMETRY_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                  "num_gpu_blocks_override", "dtype")
# vLLM flags accepted for what pagedserve does anyway; any other value fails, naming what is not
# built. Checked where they are given, carried to no process. Deployment guides put them in their
# commands, so refusing them would fail a command whose every request pagedserve serves the same.
COMPAT_FLAGS = ("trust_remote_code", "enable_chunked_prefill", "swap_space", "disable_custom_all_reduce",
                "pipeline_parallel_size", "distributed_executor_backend", "tokenizer_mode", "max_log_len",
                "disable_cascade_attn", "max_seq_len_to_capture")
ENGINE_FLAGS = SCHEDULER_FLAGS + EXECUTOR_FLAGS + COMPAT_FLAGS
DTYPES = ("auto", "float16", "bfloat16", "float32")
RUNNERS = ("auto", "generate", "pooling")
# vLLM's older --task values, each of which picks a runner.
TASK_RUNNERS = {"generate": "generate", "embed": "pooling", "embedding": "pooling", "score": "pooling",
                "classify": "pooling", "reward": "pooling"}
KV_CACHE_DTYPES = ("auto", "fp8")
SCHEDULING_POLICIES = ("fcfs", "priority")


_LORA = ("this LoRA option is not built: adapters here are the --lora-modules given at start, in the model's "
         "dtype; drop the flag")
_DOWNLOADS = "pagedserve loads a local directory or GGUF file and never downloads; pass the path of the files you want"
_MULTIMODAL = "multimodal input is not built yet: pagedserve serves text models"
_PARSER_PLUGINS = "parser plugins are not built; choose a built-in --tool-call-parser or --reasoning-parser"
_TRACING = "OpenTelemetry tracing is not built; /metrics and --enable-log-requests show each request's timing"
# vLLM's flags for what pagedserve does not build, each refused with the reason and what to do
# instead (by the command line, a --config file and LLM()), where it would only be unrecognized.
UNBUILT_VLLM_FLAGS = {
    "--long-lora-scaling-factors": _LORA, "--lora-dtype": _LORA, "--fully-sharded-loras": _LORA,
    "--speculative-config": "speculative decoding is not built yet; drop the flag",
    "--compilation-config": "pagedserve does not run torch.compile: its steps replay CUDA graphs of Triton kernels "
                            "(--enforce-eager turns the graphs off); drop the flag",
    "--enable-expert-parallel": "expert parallelism is not built yet: -tp splits every expert across the GPUs, "
                                "which computes the same; drop the flag",
    "--enable-sleep-mode": "sleep mode (freeing the GPU between uses) is not built yet; drop the flag",
    "--cpu-offload-gb": "weights offloaded to CPU memory are not built; split the model over GPUs with -tp, or "
                        "serve it as FP8 (--quantization fp8)",
    "--kv-transfer-config": "disaggregated prefill (KV transfer between engines) is not built yet",
    "--revision": _DOWNLOADS, "--tokenizer-revision": _DOWNLOADS, "--code-revision": _DOWNLOADS,
    "--download-dir": _DOWNLOADS,
    "--limit-mm-per-prompt": _MULTIMODAL, "--mm-processor-kwargs": _MULTIMODAL,
    "--guided-decoding-backend": "structured outputs always run on llguidance here; drop the flag",
    "--structured-outputs-config": "structured outputs always run on llguidance here; drop the flag",
    "--tool-parser-plugin": _PARSER_PLUGINS, "--reasoning-parser-plugin": _PARSER_PLUGINS,
    "--model-impl": "pagedserve runs its own model code only; drop the flag",
    "--root-path": "a path prefix is not built; serve at / behind a proxy that strips the prefix",
    "--api-server-count": "one gateway process serves the API here; run more gateways behind a load balancer",
    "--otlp-traces-endpoint": _TRACING, "--collect-detailed-traces": _TRACING,
}


def _flag_specs() -> dict[str, dict]:
    d = EngineConfig()
    toggle = argparse.BooleanOptionalAction
    by_device = "; by default vLLM's for the device: "
    return {
        "served_model_name": dict(nargs="+", default=d.served_model_name, metavar="NAME",
                                  help="names clients may send as `model` (the first is the one "
                                       "reported); defaults to the model path"),
        "max_model_len": dict(type=arg_types.size, default=d.max_model_len,
                              help="context length, e.g. 8192 or 8k; defaults to the model's "
                                   "max_position_embeddings (times the factor of yarn, linear or "
                                   "dynamic rope scaling; a longrope model's original context), "
                                   "and may not exceed it (longrope: max_position_embeddings)"),
        "max_num_seqs": dict(type=arg_types.positive_int, default=d.max_num_seqs,
                             help="requests running at once" + by_device + "1024 on GPUs of 70 GiB "
                                  "or more (A100s excepted), else 256; 128 (server) or 256 (offline) "
                                  "on a CPU"),
        "max_num_batched_tokens": dict(type=arg_types.size, default=d.max_num_batched_tokens,
                                       help="token budget of one step (prefill chunks plus decodes)"
                                            + by_device + "8192 (server) or 16384 (offline) on GPUs "
                                            "of 70 GiB or more, else 2048 or 8192; 2048 or 4096 on "
                                            "a CPU"),
        "max_num_queued_reqs": dict(type=arg_types.positive_int, default=d.max_num_queued_reqs,
                                    help="requests that may wait for a running slot; past it new ones "
                                         "get 503 server_overloaded with Retry-After (default: 4 x "
                                         "--max-num-seqs; the offline LLM queues without limit)"),
        "long_prefill_token_threshold": dict(type=arg_types.non_negative_int, default=d.long_prefill_token_threshold,
                                             help="the most prompt tokens one request computes in a step, so "
                                                  "that a long prompt shares steps with others (vLLM's; a "
                                                  "pooling prompt runs whole); 0: up to the step's budget"),
        "scheduling_policy": dict(default=d.scheduling_policy, choices=SCHEDULING_POLICIES,
                                  help="fcfs: requests run in arrival order, and a request with a "
                                       "nonzero priority is refused; priority: lower `priority` runs "
                                       "first (ties by arrival), the lowest-ranked running request is "
                                       "preempted first. Either way, background (batch) requests run "
                                       "after interactive ones, in what tokens those leave"),
        "block_size": dict(type=arg_types.positive_int, default=d.block_size, help="tokens per KV-cache block"),
        "gpu_memory_utilization": dict(type=arg_types.fraction, default=d.gpu_memory_utilization,
                                       help="share of GPU memory, in (0, 1], for weights, activations "
                                            "and the KV cache"),
        "num_gpu_blocks_override": dict(type=arg_types.positive_int, default=d.num_gpu_blocks_override,
                                        help="number of KV-cache blocks, skipping memory profiling"),
        "kv_cache_memory_bytes": dict(type=arg_types.size, default=d.kv_cache_memory_bytes,
                                      help="KV cache size in bytes (e.g. 4G); on a CPU it defaults to 1 GiB"),
        "enable_prefix_caching": dict(action=toggle, default=d.enable_prefix_caching,
                                      help="reuse the KV blocks of shared prompt prefixes"),
        "dtype": dict(type=arg_types.dtype, default=d.dtype, choices=DTYPES,
                      help="weights and activations; also half, float, bf16. auto: the checkpoint's on "
                           "a GPU, float32 on a CPU"),
        "seed": dict(type=int, default=d.seed, help="engine random seed"),
        "load_format": dict(default=d.load_format, choices=["auto", "safetensors", "dummy"],
                            help="dummy: random weights of the model's shapes"),
        "device": dict(default=d.device, help="auto, cpu or cuda (auto: cuda if torch sees a GPU)"),
        "enforce_eager": dict(action="store_true", help="disable CUDA graphs"),
        "async_scheduling": dict(action=toggle, default=d.async_scheduling,
                                 help="plan the next step before the previous one's result arrives, "
                                      "so the GPU does not wait for the control path"),
        "disable_log_stats": dict(action="store_true",
                                  help="no periodic line of throughput, running and waiting requests "
                                       "and KV-cache usage (every 10 s while busy)"),
        "tensor_parallel_size": dict(flags=("-tp",), type=arg_types.positive_int, default=d.tensor_parallel_size,
                                     help="GPUs per model (cuda:0 to cuda:N-1; processes on a CPU): each "
                                          "holds 1/N of the heads, MLP and vocabulary, and the executor "
                                          "starts the other N-1 ranks itself"),
        "quantization": dict(flags=("-q",), default=d.quantization,
                             type=arg_types.only("fp8", "quantization other than fp8",
                                                 "only fp8 is: FP8 weights and activations"),
                             help="fp8: FP8 E4M3 weights (per output channel) and activations (per "
                                  "token) in the decoder's linear layers; an FP8 checkpoint loads as "
                                  "FP8 without it"),
        "kv_cache_dtype": dict(default=d.kv_cache_dtype, type=arg_types.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                               help="KV-cache storage: auto (the model's dtype) or fp8 (also fp8_e4m3: "
                                    "float8_e4m3fn with per-layer K and V scales, twice the tokens)"),
        "runner": dict(default=d.runner, choices=RUNNERS,
                       help="generate: text generation; pooling: embeddings and classifier scores "
                            "(/v1/embeddings, /rerank, /score), prompts computed whole, no sampling; "
                            "auto: pooling for an encoder, a *ForSequenceClassification model or a "
                            "sentence-transformers directory, else generate"),
        "task": dict(default=d.task, choices=list(TASK_RUNNERS),
                     help="vLLM's older form of --runner: generate, or embed/embedding/score/classify/"
                          "reward for pooling"),
        "pooler_config": dict(type=arg_types.json_object, default=d.pooler_config,
                              help="JSON overriding the model's pooling (vLLM's keys): pooling_type "
                                   "LAST|MEAN|CLS, normalize, dimensions, activation"),
        "hf_overrides": dict(type=arg_types.json_object, default=d.hf_overrides,
                             help="JSON merged into config.json, e.g. for Qwen3-Reranker "
                                  "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                                  "\"classifier_from_token\": [\"no\", \"yes\"], "
                                  "\"is_original_qwen3_reranker\": true}'"),
        "max_logprobs": dict(type=arg_types.max_logprobs, default=d.max_logprobs,
                             help="the most top logprobs a request may ask for per token (logprobs, "
                                  "top_logprobs, prompt_logprobs); -1: the whole vocabulary. The "
                                  "executor holds pinned host memory of max_num_seqs x (1 + N) x 24 "
                                  "bytes for them"),
        "logprobs_mode": dict(choices=LOGPROBS_MODES, default=d.logprobs_mode,
                              help="what sampled tokens' logprobs hold (vLLM's): raw_ before any "
                                   "processor, processed_ after penalties, bias, masks, temperature, "
                                   "min_p, top_k and top_p; _logprobs log-softmaxed, _logits as they "
                                   "are. Prompt logprobs are always raw logprobs"),
        "enable_lora": dict(action="store_true",
                            help="serve the --lora-modules adapters: a request whose `model` names one "
                                 "runs the base model with it"),
        "lora_modules": dict(nargs="+", default=d.lora_modules, metavar="NAME=PATH",
                             help="LoRA adapters (PEFT directories: adapter_config.json and "
                                  "adapter_model.safetensors) as name=path or JSON {\"name\": ..., "
                                  "\"path\": ...}; needs --enable-lora"),
        "max_loras": dict(type=arg_types.positive_int, default=d.max_loras,
                          help="the most adapters that one step serves; requests of others wait"),
        "max_lora_rank": dict(type=arg_types.positive_int, default=d.max_lora_rank,
                              help="the greatest adapter rank served (vLLM's: 8, 16, 32, 64, ...)"),
        "trust_remote_code": dict(action="store_true",
                                  help="accepted for vLLM's commands; pagedserve never runs code from a "
                                       "model directory, so it changes nothing"),
        "enable_chunked_prefill": dict(action="store_true",
                                       help="accepted for vLLM's commands: long prompts are always computed "
                                            "in chunks of the step's token budget, beside running decodes"),
        "swap_space": dict(type=arg_types.non_negative_float, default=None, metavar="GiB",
                           help="accepted for vLLM's commands: a preempted request recomputes its KV cache "
                                "when it resumes (as in vLLM's V1 engine), so no CPU swap space is used"),
        "disable_custom_all_reduce": dict(action="store_true",
                                          help="accepted for vLLM's commands: tensor parallelism all-reduces "
                                               "through NCCL (gloo on a CPU), no custom kernel to disable"),
        "pipeline_parallel_size": dict(flags=("-pp",), default=None,
                                       type=arg_types.only(1, "pipeline parallelism",
                                                           "split a model over GPUs with -tp"),
                                       help="1 only (pipeline parallelism is not built; -tp splits a model)"),
        "distributed_executor_backend": dict(default=None,
                                             type=arg_types.only("mp", "a backend other than mp",
                                                                 "ranks run as processes of this machine"),
                                             help="mp only: tensor-parallel ranks are processes the executor "
                                                  "starts on this machine"),
        "max_log_len": dict(type=arg_types.non_negative_int, default=None, metavar="N",
                            help="the most characters of each output the request log shows (--enable-log-outputs; "
                                 "default: whole); it holds no prompt text or ids to cut"),
        "disable_cascade_attn": dict(action="store_true",
                                     help="accepted for vLLM's commands: attention runs no cascade (shared-"
                                          "prefix) kernel to disable"),
        "max_seq_len_to_capture": dict(type=arg_types.size, default=None, metavar="N",
                                       help="accepted for vLLM's commands: decode steps replay CUDA graphs at "
                                            "every context length, so none falls back to eager past N"),
        "tokenizer_mode": dict(default=None,
                               type=arg_types.only("auto", "a tokenizer mode other than auto",
                                                   "the model's tokenizer.json or GGUF vocabulary runs"),
                               help="auto only: the model's tokenizer.json (or its GGUF vocabulary)"),
    }


def add_engine_args(parser: argparse.ArgumentParser, names: tuple[str, ...] = ENGINE_FLAGS) -> None:
    """Adds the named flags with vLLM's spelling (all engine flags by default)."""
    specs = _flag_specs()
    g = parser.add_argument_group("engine")
    for name in names:
        spec = dict(specs[name])
        g.add_argument(flag_name(name), *spec.pop("flags", ()), **spec)


def add_geometry_checks(parser: argparse.ArgumentParser) -> None:
    """The executor's geometry flags, for a scheduler: unset by default, checked when given."""
    specs = _flag_specs()
    g = parser.add_argument_group("KV-cache geometry and batch limits (the executor's; checked "
                                  "against its Describe)")
    for name in GEOMETRY_FLAGS:
        g.add_argument(flag_name(name), **{**specs[name], "default": None})


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None})


def config_from_kwargs(model: str, kwargs: dict) -> EngineConfig:
    """An EngineConfig from vLLM's `LLM(...)` keyword arguments, each checked as its flag is;
    raises ValueError naming the argument for an unknown one or a value that is not taken."""
    specs = _flag_specs()
    names = {f.name for f in fields(EngineConfig)}
    values = {}
    for name, value in kwargs.items():
        unbuilt = UNBUILT_VLLM_FLAGS.get(flag_name(name))
        if unbuilt is not None and name not in specs:
            raise ValueError(f"LLM({name}=...): {unbuilt}")
        if name not in specs:
            close = difflib.get_close_matches(name, specs, n=1)
            hint = f"; did you mean {close[0]}?" if close else "."
            raise ValueError(f"LLM() takes no argument {name!r}{hint} It takes the engine flags as "
                             f"keywords: {', '.join(sorted(specs))}")
        values[name] = _checked(name, value, specs[name])
    return EngineConfig(model=model, **{k: v for k, v in values.items() if k in names and v is not None})


def _checked(name: str, value: object, spec: dict) -> object:
    if value is None:
        return None
    if spec.get("action") in ("store_true", argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
        return value
    if spec.get("nargs") == "+" and isinstance(value, str):
        value = [value]
    kind = spec.get("type")
    if kind is not None:
        try:
            value = kind(value)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{name}={value!r}: {e}") from None
    choices = spec.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{name}={value!r}: choose from {', '.join(choices)}")
    return value


def config_to_argv(config: EngineConfig, names: tuple[str, ...]) -> list[str]:
    """The flags among `names` that recreate `config` in a child process."""
    argv: list[str] = []
    default = EngineConfig()
    for name in names:
        value = getattr(config, name)
        if value == getattr(default, name):
            continue
        flag = flag_name(name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def flags_given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The flags among `names` that `args` sets (not empty or zero), as --name=value: to pass on to a child."""
    return [f"{flag_name(name)}={value}" for name in names if (value := getattr(args, name))]


def flag_name(name: str) -> str:
    """A flag's spelling on the command line: max_model_len -> --max-model-len."""
    return "--" + name.replace("_", "-")
