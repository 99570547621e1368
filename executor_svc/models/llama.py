"""The Llama family: Llama 2/3/3.1, Mistral, TinyLlama, SmolLM, Qwen2 (qkv bias), Qwen3 (q/k norm).

Tokens arrive flattened ([T], sequences packed one after another); attention reads and writes the
paged KV cache through the backend. q/k/v and gate/up are fused into one matmul each; their
`shards` tell the weight loader where each Hugging Face tensor goes.
"""
import itertools

import torch
from torch import nn

from pagedserve.executor_svc.attention_backend import AttentionMetadata, TorchAttentionBackend
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.models.rope import build_cos_sin_cache

KVCache = tuple[torch.Tensor, torch.Tensor]


class MergedLinear(nn.Linear):
    """Several checkpoint projections stacked along the output dim, run as one matmul."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        starts = itertools.accumulate(shard_sizes.values(), initial=0)
        self.shards = {name: (start, size) for (name, size), start in zip(shard_sizes.items(), starts)}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, backend: TorchAttentionBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = MergedLinear(config.hidden_size,
                                     {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
                                     bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
        self.qk_norm = config.qk_norm
        self.scale = self.head_dim ** -0.5
        # The fp8 KV cache's per-layer scales (vLLM's k_scale, v_scale): 1.0, as checkpoint
        # scales are not loaded yet.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        self.backend = backend

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        out = self.backend.forward(positions, q, k, v, cos_sin_cache, kv_cache[0], kv_cache[1],
                                   meta, self.scale, (self.k_scale, self.v_scale))
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate_proj": size, "up_proj": size},
                                         bias=config.mlp_bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=config.mlp_bias)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend)
        self.mlp = MLP(config, backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the next norm: each norm returns (normed, x + residual).
        if residual is None:
            residual = x
            x, _ = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta, cos_sin_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        cos_sin = build_cos_sin_cache(config.head_dim, max_positions, config.rope_theta,
                                      config.rope_scaling)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta, self.cos_sin_cache)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face's, with q/k/v fused as `qkv_proj` and gate/up as
    `gate_up_proj`. With tied embeddings there is no `lm_head`; logits use `embed_tokens`."""

    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend, max_positions)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return nn.functional.linear(hidden, head.weight).float()
