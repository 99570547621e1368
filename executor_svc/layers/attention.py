"""Self-attention over the paged KV cache: fused q/k/v (column parallel), optional q/k norms,
rotary embedding, the backend's paged attention, and o_proj (row parallel, all-reduced here); and
each layer's sliding window."""
from collections.abc import Callable

import torch
from torch import nn

from pagedserve.executor_svc.attention_backend import AttentionMetadata, TorchAttentionBackend, first_rows
from pagedserve.executor_svc.fp8 import Quantized
from pagedserve.executor_svc.kv_cache import KVCache
from pagedserve.executor_svc.layers.linear import add_projection, column_linear, input_rows, row_linear
from pagedserve.executor_svc.layers.norm import Norm
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.parallel import TensorParallel

# config.json's `layer_types`: a layer with a sliding window, or one that attends to every key.
SLIDING, FULL = "sliding_attention", "full_attention"


class Attention(nn.Module):
    """`config` holds this rank's heads; `norm` builds the q/k norms when the config has them
    (Qwen3). q and k rotate by the table the decoder stack passes in (layers.rotary).
    `sliding_window` (this layer's window, None: full attention) and `softcap` (its attention
    logit cap, None: none) go to the backend as they are."""

    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend, tp: TensorParallel | None,
                 norm: Norm, sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.qkv_proj = column_linear(config.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
                                      config.attention_bias, tp)
        self.o_proj = row_linear(q_size, config.hidden_size, config.o_proj_bias, tp)
        if config.qk_norm:
            self.q_norm = norm(self.head_dim)
            self.k_norm = norm(self.head_dim)
        self.qk_norm = config.qk_norm
        self.scale = self.head_dim ** -0.5
        self.sliding_window, self.softcap = sliding_window, softcap
        # The fp8 KV cache's per-layer scales (vLLM's k_scale, v_scale): 1.0 unless the
        # checkpoint has calibrated ones (weight_loader.KV_SCALE_SUFFIXES).
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        self.backend = backend
        self.tp = tp
        # Set by decoder.fold_norms where qkv_proj has a bias (Qwen2): q's, k's and v's, which
        # rotary adds after the folded norm's scale.
        self.folded_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor | Quantized, kv_cache: KVCache,
                meta: AttentionMetadata, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        rows = input_rows(self.o_proj, len(q))
        out = self._attend(positions, (q, k, v), kv_cache, meta, cos_sin_cache, rows)
        out = first_rows(self.o_proj(out.view(rows, -1)), len(q))
        # NCCL's all-reduce is captured in the decode CUDA graphs like the kernels around it.
        return out if self.tp is None else self.tp.all_reduce(out)

    def accumulate(self, positions: torch.Tensor, x: torch.Tensor, num_tokens: int, kv_cache: KVCache,
                   meta: AttentionMetadata, cos_sin_cache: torch.Tensor, eps: float) -> None:
        """x += this attention's output, where the layer's input RMSNorm (of `eps`) is folded into
        qkv_proj (decoder.fold_norms): x is the residual stream itself, not its norm, its first
        num_tokens rows the tokens' (the rest padding, which o_proj adds into too)."""
        out = self._attend(positions, self._qkv(x[:num_tokens]), kv_cache, meta, cos_sin_cache,
                           len(x), norm_of=(x, eps), bias=self.folded_bias)
        add_projection(x, out.view(len(x), -1), self.o_proj)

    def _attend(self, positions: torch.Tensor, qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                kv_cache: KVCache, meta: AttentionMetadata, cos_sin_cache: torch.Tensor,
                out_rows: int, **folded_norm: tuple) -> torch.Tensor:
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        # folded_norm is norm_of and bias, which only the backends that fold norms take.
        return self.backend.forward(positions, *qkv, cos_sin_cache, kv_cache[0], kv_cache[1], meta,
                                    self.scale, (self.k_scale, self.v_scale),
                                    sliding_window=self.sliding_window, softcap=self.softcap,
                                    out_rows=out_rows, qk_norm=qk_norm, **folded_norm)

    def _qkv(self, x: torch.Tensor | Quantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Heads first, then split: two ops where a split and three views took four (a CPU decode
        # step's small ops cost more than its arithmetic).
        return self.qkv_proj(x).view(-1, sum(self.heads), self.head_dim).split(self.heads, dim=1)


def layer_windows(config: ModelConfig) -> list[int | None]:
    """Each layer's sliding window, config.sliding_window (None: none): on the layers config.json's
    `layer_types` marks sliding, or on every layer without them (Mistral, Phi-3, Mixtral,
    Qwen3-MoE). A family whose transformers class defaults them spells them out in its
    read_hf_config (with_layer_types)."""
    types = config.hf_config.get("layer_types")
    if types is None:
        return [config.sliding_window] * config.num_hidden_layers
    return [config.sliding_window if kind == SLIDING else None for kind in types]


def with_layer_types(config: dict, sliding: Callable[[int], bool]) -> dict:
    """config.json with its own `layer_types`, or else those of a transformers class that defaults
    them: layer i slides where sliding(i)."""
    if config.get("layer_types"):
        return config
    return {**config, "layer_types": [SLIDING if sliding(i) else FULL for i in range(config["num_hidden_layers"])]}
