"""Tiny random Hugging Face models of each supported architecture, and transformers' greedy output
on them: the ground truth for the executor, the engine and the end-to-end tests."""
import random
from pathlib import Path

import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.executor_svc.models import MODELS

PROMPT_LENS = (3, 9, 17, 24, 31, 40, 47, 60)
# Every architecture pagedserve runs: a new one needs its entry in ARCH_CONFIGS.
ARCHITECTURES = tuple(MODELS)

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              # Wider than transformers' 0.02 so logits are spread out: fewer near-ties in argmax.
              initializer_range=0.1)

# A sliding layer and a global one, each with its own RoPE (linear scaling on the global one).
GEMMA3 = dict(sliding_window=10, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})

ARCH_CONFIGS = {
    "LlamaForCausalLM": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64}),
    # A window shorter than most prompts, so it cuts across blocks and prefill chunks.
    "MistralForCausalLM": dict(sliding_window=12, rope_theta=1e6),
    "Qwen2ForCausalLM": dict(tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(),
    # Top 2 of 8 or 4 experts (fewer experts, fewer steps of the CPU references' expert loops).
    # Qwen3-MoE renormalizes the top-k weights; Qwen2-MoE does not, and has a shared expert and a
    # dense layer 1; Mixtral always renormalizes.
    "Qwen3MoeForCausalLM": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True),
    "Qwen2MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64, mlp_only_layers=[1]),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                               sliding_window=None, rope_theta=1e6),
    # Phi-3 128K's longrope and Phi-4-mini's partial rotary (12 of 16 dims rotate: 6 factors).
    # transformers switches to the long factors once a sequence passes 256 positions, pagedserve
    # once max_model_len does (vLLM's rule); the tests stay under 256 on both sides, where both
    # use the short factors. The window is Phi-3-mini-4k's kind (2047), shortened.
    "Phi3ForCausalLM": dict(partial_rotary_factor=0.75, original_max_position_embeddings=256,
                            sliding_window=16, pad_token_id=0,
                            rope_scaling={"rope_type": "longrope",
                                          "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                          "long_factor": [1.0, 1.5, 2.5, 4.0, 8.0, 16.0]}),
    # Windows shorter than the prompts, soft-caps that bind, and a query scale other than head_dim.
    "Gemma2ForCausalLM": dict(sliding_window=12, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                              final_logit_softcapping=6.0),
    "Gemma3ForCausalLM": GEMMA3,
    "Gemma3ForConditionalGeneration": GEMMA3,
}
# Architectures whose config class is not named after them.
CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}
# The smallest SigLIP tower a Gemma 3 vision-language checkpoint can carry: one 2x2 grid of
# patches pooled into one image token.
TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   image_size=28, patch_size=14)


def make_tiny_model(arch: str, path: str | Path, **config_overrides) -> Path:
    """Saves a seeded, float32, 2-layer GQA model of `arch` as safetensors in `path`; returns it."""
    config = tiny_config(arch, {**COMMON, **ARCH_CONFIGS[arch], **config_overrides})
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(torch.float32)
    # transformers initialises norm weights to 1 and biases to 0, which would hide a swapped or
    # dropped norm or bias; randomise them too.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def tiny_config(arch: str, fields: dict) -> transformers.PretrainedConfig:
    if arch == "Gemma3ForConditionalGeneration":
        # The text model's fields in its text_config, beside a tiny vision tower.
        return transformers.Gemma3Config(text_config=fields, vision_config=TINY_VISION, mm_tokens_per_image=1)
    return getattr(transformers, CONFIG_CLASSES.get(arch, arch.replace("ForCausalLM", "Config")))(**fields)


def mixed_prompts(seed: int) -> list[list[int]]:
    """Random token ids, one prompt of each of PROMPT_LENS."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]


def hf_greedy(model: str | Path | transformers.PreTrainedModel, prompts: list[list[int]],
              max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt by `model` (or the float32 model of that
    directory), run one prompt at a time (no padding).

    EOS is disabled: every prompt gets exactly `max_new_tokens` tokens, so callers must also
    ignore EOS when comparing."""
    if not isinstance(model, transformers.PreTrainedModel):
        model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    # generate() fills unset options from the model's own generation config, eos included.
    model.generation_config.eos_token_id = None
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                           pad_token_id=0)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outputs.append(out[0, len(prompt):].tolist())
            assert len(outputs[-1]) == max_new_tokens
    return outputs


def llm_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The offline engine's greedy continuation of each prompt, EOS ignored like hf_greedy's."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]
