"""GGUF, llama.cpp's format: finds the file a --model names, turns its metadata into the
config.json a Hugging Face checkpoint would carry, and reads its tensors under Hugging Face names,
dequantized one at a time (or one rank's slice of each: only the blocks of that slice)."""
import functools
from pathlib import Path
from typing import Any, Callable, Iterator

import gguf
import numpy as np
import torch

from pagedserve.common.gguf_metadata import GGUFTensorInfo, read_gguf_header

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# llama.cpp runs Mixtral as a llama model with experts.
LLAMA_WITH_EXPERTS = "MixtralForCausalLM"
# convert_hf_to_gguf permutes q/k rows into llama.cpp's rope layout only for llama-arch models
# (LlamaModel.undo_permute); Qwen's converters write them as they are.
PERMUTED_ARCHITECTURES = ("llama",)

MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # A mixture of experts: the router, every expert's projections stacked [E, ...] (the weight
    # loader splits them per expert), the shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma's norms: one after attention and one on each side of the MLP, where Llama's ffn_norm is
# the MLP's input norm.
GEMMA_LAYER_TENSORS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
# Each architecture's own names over LAYER_TENSORS. Phi-3's converter keeps the checkpoint's fused
# projections: q/k/v in attn_qkv, gate/up in ffn_up.
ARCH_LAYER_TENSORS = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                      "gemma2": GEMMA_LAYER_TENSORS, "gemma3": GEMMA_LAYER_TENSORS}
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# llama.cpp hard-codes what Gemma's converter does not write: one global layer in every 2 (Gemma 2)
# or 6 (Gemma 3), transformers' defaults too (models/gemma.py fills `layer_types` with them), the
# sliding layers' RoPE base (Gemma 3), and the query scale, 1/sqrt(head_dim) except for the 27B
# models, which it tells by their layer count: 1/sqrt(hidden / heads).
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Llama 3.1's rope scaling, stored by the converter as per-frequency divisors instead of metadata.
ROPE_FREQS = "rope_freqs.weight"
# Phi-3 128K's longrope factors, stored by the converter as tensors.
ROPE_FACTORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}
ROPE_TENSORS = (ROPE_FREQS, *ROPE_FACTORS.values())
FLOAT_TYPES = {gguf.GGMLQuantizationType.F32: "float32", gguf.GGMLQuantizationType.BF16: "bfloat16"}


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `model` names: the file itself, or the one *.gguf in a directory that has no
    config.json. None for anything else (a Hugging Face directory)."""
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}): "
                         "pass --model the path of the one to serve")
    return files[0] if files else None


def read_gguf_config(path: Path) -> dict:
    """The config.json (plus generation_config's eos_token_id) of the model in a GGUF file."""
    header = read_gguf_header(path)
    arch = _architecture(header.metadata, path)
    meta = functools.partial(_arch_field, header.metadata, arch)
    tensors = {t.name: t for t in header.tensors}
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length", hidden // heads)
    experts = _experts(meta, arch)
    config = {
        "architectures": [LLAMA_WITH_EXPERTS if arch == "llama" and experts else ARCHITECTURES[arch]],
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_parameters": {"rope_theta": meta("rope.freq_base", 10000.0),
                            **_rope_scaling(meta, path, tensors)},
        "partial_rotary_factor": meta("rope.dimension_count", head_dim) / head_dim,
        "max_position_embeddings": meta("context_length"),
        # 0 for none (Phi-4's converter writes it so).
        "sliding_window": meta("attention.sliding_window") or None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "dtype": _dtype(tensors.values()),
        "eos_token_id": _eos_token_ids(header.metadata),
        **experts,
    }
    if (original := meta("rope.scaling.original_context_length")) is not None:
        config["original_max_position_embeddings"] = original
    if arch in GEMMA_ARCHITECTURES:
        config.update(_gemma_config(meta, arch, config))
    return config


def read_gguf_tensors(path: Path) -> Iterator[tuple[str, tuple[int, ...], Callable[..., torch.Tensor]]]:
    """(Hugging Face name, shape, reader) for each tensor; a reader dequantizes its tensor, or the
    slice `index` of it, to float32 on the host when called. A name this module does not know is
    passed on as it is."""
    header = read_gguf_header(path)
    data = map_gguf(path)
    arch = _architecture(header.metadata, path)
    rope_heads = {}
    if arch in PERMUTED_ARCHITECTURES:
        heads = _arch_field(header.metadata, arch, "attention.head_count")
        rope_heads = {"q_proj": heads,
                      "k_proj": _arch_field(header.metadata, arch, "attention.head_count_kv", heads)}
    layer_tensors = {**LAYER_TENSORS, **ARCH_LAYER_TENSORS.get(arch, {})}
    for tensor in header.tensors:
        if tensor.name in ROPE_TENSORS:
            continue
        name = hf_name(tensor.name, layer_tensors)
        module = name.rpartition(".")[0].rpartition(".")[2]
        read = functools.partial(dequantize, data, tensor, rope_heads.get(module))
        if arch in GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
            read = functools.partial(_unshift_norm, read)
        yield name, tensor.shape, read


def map_gguf(path: Path) -> np.memmap:
    """The whole file as read-only bytes, mapped rather than read: a tensor's pages are read when
    it is dequantized."""
    return np.memmap(path, dtype=np.uint8, mode="r")


def hf_name(name: str, layer_tensors: dict[str, str] = LAYER_TENSORS) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (`layer_tensors`: an
    architecture's names of a layer's tensors); unknown names unchanged."""
    base, _, param = name.rpartition(".")
    if base in MODEL_TENSORS:
        return f"{MODEL_TENSORS[base]}.{param}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{param}"
    return name


def dequantize(data: np.memmap, tensor: GGUFTensorInfo, rope_heads: int | None = None,
               index: tuple[int | slice, ...] | None = None) -> torch.Tensor:
    """The tensor of the mapped file `data` (or its slice `index`, which must cut rows at head
    boundaries when `rope_heads`; an int picks one expert of a stacked [E, ...] tensor) as float32
    in numpy's dimension order, its rows un-permuted when `rope_heads`."""
    raw = data[tensor.offset:tensor.offset + tensor.n_bytes]
    # Quantized blocks are dequantized from rows of bytes: a row of blocks per row of weights.
    raw = raw.reshape(gguf.quant_shape_to_byte_shape(tensor.shape, tensor.ggml_type))
    columns = None
    if index is not None:
        byte_index, columns = _byte_index(index, tensor)
        raw = raw[byte_index]
    weights = _dequantize_rows(raw, tensor)
    if columns is not None:
        weights = weights[..., columns]
    if rope_heads is None:
        return weights
    return unpermute(weights, rope_heads * weights.shape[0] // tensor.shape[0])


def _dequantize_rows(raw: np.ndarray, tensor: GGUFTensorInfo) -> torch.Tensor:
    if tensor.ggml_type in TORCH_DEQUANTIZERS:
        _, type_size = gguf.GGML_QUANT_SIZES[tensor.ggml_type]
        blocks = torch.from_numpy(np.array(raw)).view(-1, type_size)
        return TORCH_DEQUANTIZERS[tensor.ggml_type](blocks).view(*raw.shape[:-1], -1)
    try:
        values = gguf.quants.dequantize(raw, tensor.ggml_type)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {tensor.name} has type {tensor.ggml_type.name}, which "
                         "pagedserve cannot dequantize; use a GGUF of a float or llama.cpp quant "
                         "type (F16, Q8_0, Q4_K_M, ...)") from None
    # F32 data comes back as a view of the read-only file mapping, which torch will not wrap.
    if not values.flags.writeable:
        values = values.copy()
    return torch.from_numpy(values)


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # gguf-py's operations (quants.Q8_0), in the same order, so the same float32 values.
    return blocks[:, 2:].view(torch.int8).float() * blocks[:, :2].view(torch.float16).float()


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # As gguf-py's quants.Q4_1: low nibbles are the block's first 16 values, high ones the rest.
    d, m = (blocks[:, i:i + 2].view(torch.float16).float() for i in (0, 2))
    nibbles = torch.cat((blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4), dim=1).float()
    return d * nibbles + m


# The default model's block types, on torch's threads: gguf-py dequantizes in numpy on one. Reading
# all of SmolLM2's tensors took 0.7 s with these against 1.6 s for gguf-py's Q4_1 and Q8_0 alone
# (the 2-core CPU).
TORCH_DEQUANTIZERS = {gguf.GGMLQuantizationType.Q8_0: _dequantize_q8_0,
                      gguf.GGMLQuantizationType.Q4_1: _dequantize_q4_1}


def _byte_index(index: tuple[int | slice, ...], tensor: GGUFTensorInfo) -> tuple[tuple, slice | None]:
    """`index` into the tensor's bytes, and the columns still to take once they are dequantized:
    when its innermost slice cuts through blocks, all of them are read (only in the rows that
    the outer part of `index` picks)."""
    block, type_size = gguf.GGML_QUANT_SIZES[tensor.ggml_type]
    *outer, last = (*index, *(slice(None),) * (len(tensor.shape) - len(index)))
    start, stop, _ = last.indices(tensor.shape[-1])
    if start % block or stop % block:
        return (*outer, slice(None)), last
    return (*outer, slice(start // block * type_size, stop // block * type_size)), None


def unpermute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Undoes convert_hf_to_gguf's LlamaModel.permute, which interleaves the two rotary halves of
    each head's rows for llama.cpp's rope."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape)


def _architecture(metadata: dict, path: Path) -> str:
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}: pagedserve runs "
                         f"{', '.join(ARCHITECTURES)}")
    return arch


def _experts(meta: Callable[..., Any], arch: str) -> dict:
    """config.json's fields for the experts of a mixture-of-experts file ({} for a dense one).
    llama.cpp makes every layer sparse, and renormalizes the top-k routing weights of qwen3moe
    and llama (Mixtral) models but not of qwen2moe ones."""
    if not meta("expert_count", 0):
        return {}
    fields = {"num_experts": meta("expert_count"), "num_experts_per_tok": meta("expert_used_count"),
              "norm_topk_prob": arch != "qwen2moe"}
    for key, field in (("expert_feed_forward_length", "moe_intermediate_size"),
                       ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
        if meta(key) is not None:
            fields[field] = meta(key)
    return fields


def _gemma_config(meta: Callable[..., Any], arch: str, config: dict) -> dict:
    """What Gemma's config.json holds beyond Llama's, as llama.cpp reads the file."""
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    query_scalar = head_dim
    if layers == GEMMA_27B_LAYERS[arch]:
        query_scalar = config["hidden_size"] // config["num_attention_heads"]
    gemma = {"query_pre_attn_scalar": query_scalar, "final_logit_softcapping": meta("final_logit_softcapping")}
    if arch == "gemma2":
        return {**gemma, "attn_logit_softcapping": meta("attn_logit_softcapping")}
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA},
            "full_attention": {"rope_type": "default", **config["rope_parameters"]}}
    return {**gemma, "rope_parameters": rope}


def _unshift_norm(read: Callable[..., torch.Tensor], index: tuple[slice, ...] | None = None) -> torch.Tensor:
    # Gemma's converter stores its norms' 1 + weight: the checkpoint's weight is that minus 1
    # (exact for the stored values >= 0.5, Sterbenz's lemma; within an ulp of 1 below them).
    return read(index=index) - 1


def _rope_scaling(meta: Callable[..., Any], path: Path, tensors: dict[str, GGUFTensorInfo]) -> dict:
    if ROPE_FREQS in tensors:
        return {"rope_type": "llama3", "freq_factors": _values(path, tensors[ROPE_FREQS])}
    if ROPE_FACTORS["long_factor"] in tensors:
        return {"rope_type": "longrope", "attention_factor": meta("rope.scaling.attn_factor"),
                **{key: _values(path, tensors[name]) for key, name in ROPE_FACTORS.items()}}
    rope_type = meta("rope.scaling.type", "none")
    if rope_type == "none":
        return {}
    return {"rope_type": rope_type, "factor": meta("rope.scaling.factor"),
            "original_max_position_embeddings": meta("rope.scaling.original_context_length")}


def _values(path: Path, tensor: GGUFTensorInfo) -> list[float]:
    return dequantize(map_gguf(path), tensor).tolist()


def _dtype(tensors) -> str:
    types = {t.ggml_type for t in tensors if len(t.shape) > 1}
    if len(types) == 1 and (only := types.pop()) in FLOAT_TYPES:
        return FLOAT_TYPES[only]
    # F16 weights and the scales of quantized blocks are float16.
    return "float16"


def _eos_token_ids(metadata: dict) -> list[int]:
    ids = (metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot"))
    return list(dict.fromkeys(i for i in ids if i is not None))


def _arch_field(metadata: dict, arch: str, key: str, default: Any = None) -> Any:
    value = metadata.get(f"{arch}.{key}", default)
    if isinstance(value, float):
        # GGUF stores these hyperparameters as float32: the shortest decimal that rounds to the
        # stored float32, as config.json would write it (1e-06 rather than 9.99999997e-07).
        return float(str(np.float32(value)))
    return value
