"""Gemma 2 and Gemma 3 (text): GeGLU, RMSNorms that scale by (1 + weight), embeddings scaled by
√hidden, a norm after attention and another around the MLP, queries scaled by
query_pre_attn_scalar ** -0.5, and sliding-window layers interleaved with global ones
(`layer_types`). Gemma 2 soft-caps its attention and final logits; Gemma 3 norms q and k, and
rotates its sliding layers by their own RoPE base. A Gemma3ForConditionalGeneration checkpoint
serves as its text model: the vision tower and projector are skipped.

The norms hold 1 + the checkpoint's weight, added at load in float32 whatever the model's dtype
(in bf16, 1 + w would lose the low bits of w); the shared RMSNorm kernels then compute Gemma's."""
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from pagedserve.common.log import get_logger
from pagedserve.executor_svc.attention_backend import AttentionMetadata, TorchAttentionBackend
from pagedserve.executor_svc.kv_cache import KVCache
from pagedserve.executor_svc.layers.attention import FULL, SLIDING, Attention, layer_windows, with_layer_types
from pagedserve.executor_svc.layers.decoder import CausalLM, DecoderLayer, DecoderModel
from pagedserve.executor_svc.layers.mlp import GatedMLP
from pagedserve.executor_svc.layers.norm import Norm, RMSNorm
from pagedserve.executor_svc.layers.rotary import cos_sin_cache, rope_from_config
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.parallel import TensorParallel
from pagedserve.executor_svc.weight_loader import CheckpointTensor

log = get_logger(__name__)

# transformers' Gemma2Config and Gemma3TextConfig defaults for the fields a Hub config.json may
# leave out (Gemma 3's text_config often holds only a few).
GEMMA2_DEFAULTS = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256,
                       sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
GEMMA3_DEFAULTS = dict(GEMMA2_DEFAULTS, vocab_size=262208, max_position_embeddings=131072,
                       attn_logit_softcapping=None, final_logit_softcapping=None)
# Gemma3ForConditionalGeneration's config.json: what its top level says for the whole model.
TOP_LEVEL_KEYS = ("architectures", "eos_token_id", "tie_word_embeddings", "dtype", "torch_dtype",
                  "quantization_config")
# Checkpoint name prefixes of Gemma 3's text model (transformers 5's and 4's), and of its vision parts.
TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                 "language_model.lm_head.": "lm_head."}
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose float32 weight is Gemma's 1 + weight (Gemma2ForCausalLM.checkpoint_tensors
    adds the 1)."""

    def __init__(self, size: int, eps: float, backend: TorchAttentionBackend) -> None:
        super().__init__(size, eps, backend)
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))


class GemmaDecoderLayer(DecoderLayer):
    """Attention, then the MLP, each between two norms: the second one's output is what joins
    the residual stream."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module, norm: Norm) -> None:
        super().__init__(config, self_attn, mlp, norm)
        self.pre_feedforward_layernorm = norm(config.hidden_size)
        self.post_feedforward_layernorm = norm(config.hidden_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata, cos_sin_cache: torch.Tensor,
                quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.attend(positions, x, residual, kv_cache, meta, cos_sin_cache, quantize)
        x, _ = self.post_attention_layernorm(x)
        x, residual = self.pre_feedforward_layernorm(x, residual, quantize and self.quantize_mlp_input)
        x, _ = self.post_feedforward_layernorm(self.mlp(x, quantize))
        return x, residual


class LayerTypeRotary(nn.Module):
    """The cos/sin tables of the two layer types, `full` and `sliding` (one tensor when their
    ropes agree, as in Gemma 2)."""

    def __init__(self, hf_config: dict, max_positions: int) -> None:
        super().__init__()
        full, sliding = rope_from_config(hf_config, FULL), rope_from_config(hf_config, SLIDING)
        self.register_buffer("full", cos_sin_cache(full, max_positions), persistent=False)
        self.register_buffer("sliding", self.full if sliding == full else cos_sin_cache(sliding, max_positions),
                             persistent=False)


class GemmaModel(DecoderModel):
    """Embeddings times √hidden, rounded to the model's dtype as transformers rounds it; each
    layer rotates by its layer type's table."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None, make_layer: Callable[[int], nn.Module],
                 norm: Norm, rotary: LayerTypeRotary) -> None:
        super().__init__(config, tp, make_layer, norm, rotary)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5, dtype=torch.get_default_dtype()),
                             persistent=False)
        self.sliding = [t == SLIDING for t in config.hf_config["layer_types"]]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        # Two buffer reads a step rather than a lookup per layer, measured at ~1.9 µs a layer.
        full, sliding = self.rotary_emb.full, self.rotary_emb.sliding
        tables = [sliding if s else full for s in self.sliding]
        return self.decode(self.embed_tokens(input_ids) * self.embed_scale, positions, kv_caches, meta, tables)


class Gemma2ForCausalLM(CausalLM):
    decoder_model = GemmaModel
    defaults = GEMMA2_DEFAULTS
    # Gemma 2 soft-caps attention logits; Gemma 3 has q/k norms instead.
    attention_softcap = True
    qk_norm = False

    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend, max_positions: int,
                 tp: TensorParallel | None = None) -> None:
        hf = config.hf_config
        norm = partial(GemmaRMSNorm, eps=config.rms_norm_eps, backend=backend)
        attention_config = replace(config, qk_norm=self.qk_norm)
        softcap = hf["attn_logit_softcapping"] if self.attention_softcap else None
        windows = layer_windows(config)

        def layer(index: int) -> GemmaDecoderLayer:
            attention = Attention(attention_config, backend, tp, norm, windows[index], softcap)
            attention.scale = hf["query_pre_attn_scalar"] ** -0.5
            return GemmaDecoderLayer(config, attention, GatedMLP(config, backend, tp), norm)
        super().__init__(config, tp, layer, norm, LayerTypeRotary(hf, max_positions))
        self.final_logit_softcapping = hf["final_logit_softcapping"]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """CausalLM's logits in float32, soft-capped: cap * tanh(logits / cap)."""
        logits = super().compute_logits(hidden).float()
        cap = self.final_logit_softcapping
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    @classmethod
    def read_hf_config(cls, config: dict) -> dict:
        """config.json with transformers' defaults filled in, `hidden_activation` as hidden_act,
        `layer_types` spelled out and, for Gemma 3, the RoPE of each layer type."""
        if config.get("use_bidirectional_attention"):
            raise ValueError("this Gemma config sets use_bidirectional_attention (an embedding model such "
                             "as EmbeddingGemma); pagedserve serves causal text generation")
        config = {**cls.defaults, **config}
        config["hidden_act"] = config["hidden_activation"]
        pattern = cls.sliding_window_pattern(config)
        return with_layer_types(config, lambda i: (i + 1) % pattern != 0)

    @staticmethod
    def sliding_window_pattern(config: dict) -> int:
        """One layer in this many is global, the others slide (without `layer_types`)."""
        return 2

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, CheckpointTensor]]
                           ) -> Iterator[tuple[str, CheckpointTensor]]:
        """Gemma 3's text-model names as this model's, its vision weights skipped (logged once),
        and 1 added to every norm weight, in float32."""
        skipped = 0
        for name, tensor in tensors:
            if name.startswith(VISION_PREFIXES):
                skipped += 1
                continue
            prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                name = TEXT_PREFIXES[prefix] + name.removeprefix(prefix)
            if name.endswith("norm.weight"):
                tensor = CheckpointTensor(tensor.shape, lambda index, read=tensor.read: read(index).float() + 1)
            yield name, tensor
        if skipped:
            log.info("vision_weights_skipped", tensors=skipped,
                     reason="pagedserve serves the text model of Gemma 3; image inputs are refused")


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    defaults = GEMMA3_DEFAULTS
    attention_softcap = False
    qk_norm = True

    @classmethod
    def read_hf_config(cls, config: dict) -> dict:
        text = config.get("text_config")
        if text is not None:
            # Gemma3ForConditionalGeneration: the text model's fields, the whole model's name,
            # EOS, dtype and tying.
            config = {**text, **{k: config[k] for k in TOP_LEVEL_KEYS if k in config}}
        config = super().read_hf_config(config)
        config["rope_parameters"] = _rope_per_layer_type(config)
        config.pop("rope_scaling", None)
        return config

    @staticmethod
    def sliding_window_pattern(config: dict) -> int:
        return config.get("sliding_window_pattern", 6)


def _rope_per_layer_type(config: dict) -> dict:
    """transformers' Gemma3TextConfig.convert_rope_params_to_dict: transformers 5's
    `rope_parameters` per layer type, or the legacy `rope_theta` + `rope_scaling` for the global
    layers and `rope_local_base_freq` for the sliding ones."""
    given = config.get("rope_parameters") or {}
    params = {t: dict(given[t]) for t in (FULL, SLIDING) if given.get(t)}
    full = params.setdefault(FULL, {"rope_type": "default"})
    full.update(config.get("rope_scaling") or {})
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    sliding = params.setdefault(SLIDING, {"rope_type": "default"})
    sliding.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    return params
