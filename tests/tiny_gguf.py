"""Writes a tiny Hugging Face checkpoint as GGUF the way llama.cpp's convert_hf_to_gguf.py does:
gguf's own tensor-name map, 1-D tensors in F32, q/k rows of llama-arch models permuted for
llama.cpp's rope, Llama 3.1 rope scaling as a `rope_freqs` tensor, Phi-3's fused projections as
they are (attn_qkv, ffn_up) and its longrope factors as `rope_factors_long` / `_short` tensors,
MoE experts stacked, Gemma's norms as 1 + weight and no lm_head."""
import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

Q = gguf.GGMLQuantizationType
GGUF_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
              "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe",
              "MixtralForCausalLM": "llama", "Phi3ForCausalLM": "phi3",
              "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
GEMMA = ("gemma2", "gemma3")
# An expert's tensor in a Hugging Face checkpoint: `<block>.experts.<e>.<projection>.weight`.
EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")


def write_gguf(hf_dir: Path, path: Path, outtype: Q = Q.F32, quantize: dict[str, Q] | None = None,
               arch: str | None = None, retype: dict[str, np.ndarray] | None = None) -> Path:
    """Converts `hf_dir` into the GGUF file `path`; returns it. `outtype` is the type of 2-D
    tensors, `quantize` sets it per GGUF tensor name, `retype` replaces a tensor's data (e.g. with
    an integer array), `arch` overrides general.architecture."""
    config = json.loads((hf_dir / "config.json").read_text())
    hf_arch = GGUF_ARCHS[config["architectures"][0]]
    writer = gguf.GGUFWriter(path, arch or hf_arch)
    (write_gemma_metadata if hf_arch in GEMMA else write_metadata)(writer, config, hf_arch)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[hf_arch.upper()], config["num_hidden_layers"])
    for hf_name, data in stack_experts(load_file(hf_dir / "model.safetensors")).items():
        if hf_arch in GEMMA:
            if hf_name == "lm_head.weight":
                continue
            # Gemma's converter stores its norms' 1 + weight, which llama.cpp multiplies by.
            data = data + 1 if hf_name.endswith("norm.weight") else data
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = permute_for_rope(hf_name, data, config) if hf_arch == "llama" else data
        # The converter keeps routers (ffn_gate_inp, ffn_gate_inp_shexp) in F32.
        qtype = Q.F32 if ".ffn_gate_inp" in name else outtype
        add_tensor(writer, name, (retype or {}).get(name, data), (quantize or {}).get(name, qtype))
    if (rope := config.get("rope_parameters") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config, rope))
    if rope.get("rope_type") == "longrope":
        write_longrope(writer, config, rope)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_dims(writer: gguf.GGUFWriter, config: dict) -> None:
    """What every converter writes: the context, the widths, the layers, the heads, the norm's eps."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def write_metadata(writer: gguf.GGUFWriter, config: dict, arch: str) -> None:
    write_dims(writer, config)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    if arch == "phi3":
        write_phi3_metadata(writer, config)
    else:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config["head_dim"])
    writer.add_eos_token_id(config["eos_token_id"])
    if experts := config.get("num_experts") or config.get("num_local_experts"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """convert_hf_to_gguf's merge of each layer's experts: `<block>.experts.<e>.<projection>.weight`
    stacked over e into `<block>.experts.<projection>.weight` [E, ...]; other tensors as they are."""
    out, experts = {}, {}
    for name, data in tensors.items():
        match = EXPERT.fullmatch(name)
        if match is None:
            out[name] = data
        else:
            experts.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = data
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def write_phi3_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    """Phi3MiniModel.set_gguf_parameters: no key length (hidden / heads), the rotated dims, the
    original context, and the window (0 for none)."""
    partial = config["rope_parameters"].get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count(int(partial * config["hidden_size"]) // config["num_attention_heads"])
    writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
    writer.add_sliding_window(config.get("sliding_window") or 0)


def write_longrope(writer: gguf.GGUFWriter, config: dict, rope: dict) -> None:
    """Phi3MiniModel.generate_extra_tensors: the attention factor as metadata, the factors as
    tensors."""
    original = config["original_max_position_embeddings"]
    scale = config["max_position_embeddings"] / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def write_gemma_metadata(writer: gguf.GGUFWriter, config: dict, arch: str) -> None:
    """convert_hf_to_gguf's Gemma2Model / Gemma3Model.set_gguf_parameters: no RoPE base for Gemma 2
    (llama.cpp assumes 10000), the global layers' base and linear scaling for Gemma 3."""
    write_dims(writer, config)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_sliding_window(config["sliding_window"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    else:
        rope = config["rope_parameters"]["full_attention"]
        writer.add_rope_freq_base(rope["rope_theta"])
        if rope["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    writer.add_eos_token_id(config["eos_token_id"])


def add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Q) -> None:
    if data.dtype != np.float32 or data.ndim == 1:
        writer.add_tensor(name, data)
    elif qtype == Q.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def permute_for_rope(hf_name: str, data: np.ndarray, config: dict) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute of q_proj and k_proj rows."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    n_head = heads.get(hf_name.split(".")[-2])
    if n_head is None:
        return data
    return (data.reshape(n_head, 2, data.shape[0] // n_head // 2, *data.shape[1:])
            .swapaxes(1, 2).reshape(data.shape))


def llama3_rope_factors(config: dict, rope: dict) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.generate_extra_tensors for rope_type llama3."""
    dim = config["head_dim"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high:
            factors.append(1.0)
        elif wavelen > old_context_len / low:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
