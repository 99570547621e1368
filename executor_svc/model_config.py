"""The model's shape, read from a Hugging Face model directory's config.json or a GGUF file."""
import json
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.executor_svc.gguf_file import find_gguf, read_gguf_config
from pagedserve.executor_svc.layers.activation import ACTIVATIONS
from pagedserve.executor_svc.layers.rotary import Rope, rope_from_config


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    # The rotary embedding every layer uses (a family with a rope per layer type reads its own
    # from hf_config with rope_from_config).
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: str | None
    eos_token_ids: list[int]
    sliding_window: int | None
    # The checkpoint's own quantization (config.json's quantization_config): "fp8" or None.
    quantization: str | None = None
    # config.json as read (or as a GGUF file's metadata gives it): what only one family reads
    # (experts, soft caps, layer types) its own file takes from here, not a field above.
    hf_config: dict = field(default_factory=dict)


def load_model_config(model: str | Path, hf_overrides: dict | None = None) -> ModelConfig:
    """Reads a GGUF file's metadata, or a Hugging Face model directory's `config.json` (and
    `generation_config.json` when present), updated by `hf_overrides` (--hf-overrides)."""
    gguf_path = find_gguf(model)
    if gguf_path is not None:
        return model_config_from_dict(apply_hf_overrides(read_gguf_config(gguf_path), hf_overrides))
    model_dir = Path(model)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be a Hugging Face model directory "
                                "holding config.json, or a .gguf file")
    generation_path = model_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
    return model_config_from_dict(apply_hf_overrides(json.loads(path.read_text()), hf_overrides), generation)


def apply_hf_overrides(config: dict, overrides: dict | None) -> dict:
    """config.json updated by --hf-overrides. A decoder made a yes/no-token reranker (vLLM's
    classifier_from_token, with a *ForSequenceClassification architecture) runs as its causal LM,
    whose lm_head rows the pooler's classifier is built from (executor_svc/pooler.py)."""
    config = {**config, **(overrides or {})}
    if config.get("classifier_from_token"):
        config["architectures"] = [name.replace("ForSequenceClassification", "ForCausalLM")
                                   for name in config.get("architectures") or []]
    return config


def model_config_from_dict(config: dict, generation_config: dict | None = None) -> ModelConfig:
    """Builds a ModelConfig from config.json's contents (e.g. a named shape for dummy weights)."""
    architecture = _architecture(config)
    model_class = _model_class(architecture)
    config = model_class.read_hf_config(config)
    hidden_act = config.get("hidden_act", "silu")
    # An encoder's MLP is not gated: its class names the activations it implements.
    activations = getattr(model_class, "hidden_acts", ACTIVATIONS)
    if hidden_act not in activations:
        raise ValueError(f"{architecture} with hidden_act={hidden_act!r} is not supported; pagedserve "
                         f"implements {', '.join(activations)}")
    heads = config["num_attention_heads"]
    qwen2 = architecture == "Qwen2ForCausalLM"
    bias = bool(config.get("attention_bias", False))
    return ModelConfig(
        architecture=architecture,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        hidden_act=hidden_act,
        rope=rope_from_config(config),
        max_position_embeddings=config["max_position_embeddings"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=qwen2 or bias,
        o_proj_bias=bias and not qwen2,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        dtype=config.get("dtype") or config.get("torch_dtype"),
        eos_token_ids=_eos_token_ids(config, generation_config),
        sliding_window=_sliding_window(config, architecture),
        quantization=_quantization(config.get("quantization_config")),
        hf_config=config,
    )


def resolve_max_model_len(model: ModelConfig, requested: int | None) -> int:
    """The context length to serve: `requested` (--max-model-len) or the model's default, as
    vLLM derives them. Rope scaling extends the model's maximum: linear and dynamic to
    max_position_embeddings × factor, yarn to original_max_position_embeddings × factor; a
    longrope model (Phi-3 128K) defaults to its original context, where its short factors
    apply, and takes up to max_position_embeddings when asked."""
    longest, source = _longest_context(model)
    scaling = model.rope.scaling or {}
    longrope = scaling.get("rope_type") == "longrope"
    max_model_len = requested or (scaling["original_max_position_embeddings"] if longrope else longest)
    if max_model_len > longest:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's {source}; lower it")
    return max_model_len


def _longest_context(model: ModelConfig) -> tuple[int, str]:
    """The longest context the model's positions reach, and where that number comes from."""
    max_positions = model.max_position_embeddings
    scaling = model.rope.scaling or {}
    rope_type, factor = scaling.get("rope_type"), scaling.get("factor")
    extends = factor is not None and rope_type in ("linear", "dynamic", "yarn")
    # Gemma 3's max_position_embeddings counts its linear scaling already (vLLM's exception).
    if not extends or "gemma3" in model.hf_config.get("model_type", ""):
        return max_positions, f"max_position_embeddings ({max_positions})"
    if rope_type == "yarn":
        original = scaling["original_max_position_embeddings"]
        return int(original * factor), (f"max_position_embeddings as yarn scaling extends it "
                                        f"({original} original positions × factor {factor})")
    return int(max_positions * factor), (f"max_position_embeddings as {rope_type} rope scaling "
                                         f"extends it ({max_positions} × factor {factor})")


def _architecture(config: dict) -> str:
    # Imported here, not at the top: the model files import this module for ModelConfig.
    from pagedserve.executor_svc.models import ENCODERS, MODELS
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or (architectures[0] not in MODELS and architectures[0] not in ENCODERS):
        raise ValueError(f"unsupported architecture {architectures}: pagedserve runs "
                         f"{', '.join([*MODELS, *ENCODERS])}")
    return architectures[0]


def _model_class(architecture: str) -> type:
    from pagedserve.executor_svc.models import ENCODERS, MODELS  # imported here, as in _architecture
    return MODELS.get(architecture) or ENCODERS[architecture]


def _eos_token_ids(config: dict, generation_config: dict | None) -> list[int]:
    eos = (generation_config or {}).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _sliding_window(config: dict, architecture: str) -> int | None:
    # Qwen configs carry a window they only use when use_sliding_window is set.
    if architecture.startswith("Qwen") and not config.get("use_sliding_window", False):
        return None
    return config.get("sliding_window")


def _quantization(quant: dict | None) -> str | None:
    """ "fp8" for an FP8 checkpoint pagedserve loads (per-tensor or per-channel weight scales);
    raises for any other quantization_config."""
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        if quant.get("weight_block_size"):
            raise ValueError(f"block-wise FP8 checkpoints (weight_block_size {quant['weight_block_size']}) "
                             "are not supported; pagedserve loads per-tensor or per-channel FP8, or "
                             "quantizes a bf16 checkpoint with --quantization fp8")
        return "fp8"
    if method == "compressed-tensors":
        for group in quant.get("config_groups", {}).values():
            _check_fp8_weights(group.get("weights") or {})
        ignored = [name for name in quant.get("ignore", []) if not name.endswith("lm_head")]
        if ignored:
            raise ValueError(f"this compressed-tensors checkpoint leaves {ignored[:3]} unquantized; "
                             "pagedserve loads checkpoints whose every decoder Linear is FP8")
        return "fp8"
    raise ValueError(f"quantization method {method!r} is not supported; pagedserve loads FP8 "
                     "checkpoints (quant_method fp8 or compressed-tensors) and quantizes bf16/fp16 "
                     "ones with --quantization fp8")


def _check_fp8_weights(weights: dict) -> None:
    kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
    if kind not in (("float", 8, "tensor"), ("float", 8, "channel")):
        raise ValueError(f"compressed-tensors weights of type {kind[0]}, {kind[1]} bits, strategy "
                         f"{kind[2]} are not supported; pagedserve loads FP8 (float, 8 bits) weights "
                         "with per-tensor or per-channel scales")
