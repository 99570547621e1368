"""The Llama family: Llama 2/3/3.1, Mistral, TinyLlama, SmolLM, Qwen2 (qkv bias), Qwen3 (q/k norm).

Tokens arrive flattened ([T], sequences packed one after another); attention reads and writes the
paged KV cache through the backend. q/k/v and gate/up are fused into one matmul each; their
`shards` tell the weight loader where each Hugging Face tensor goes.

Under tensor parallelism (`tp`) the config holds one rank's shapes (parallel.shard_config): q/k/v
and gate/up are column parallel (each rank holds its heads and its share of the MLP width), o_proj
and down_proj row parallel (each rank's partial product is all-reduced here, in Attention and MLP,
not in the Linear), and the embedding and LM head vocab parallel. A sharded module's `tp_split`
tells the weight loader which slice of each checkpoint tensor it holds.
"""
import itertools

import torch
from torch import nn

from pagedserve.executor_svc.attention_backend import AttentionMetadata, TorchAttentionBackend
from pagedserve.executor_svc.fp8 import Fp8Linear, Quantized, takes_quantized
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.models.rope import build_cos_sin_cache
from pagedserve.executor_svc.parallel import TensorParallel

KVCache = tuple[torch.Tensor, torch.Tensor]


class MergedLinear(nn.Linear):
    """Several checkpoint projections stacked along the output dim, run as one matmul."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        starts = itertools.accumulate(shard_sizes.values(), initial=0)
        self.shards = {name: (start, size) for (name, size), start in zip(shard_sizes.items(), starts)}


class RowParallelLinear(nn.Linear):
    """This rank's slice of a projection's input dim; the caller all-reduces the partial products.
    Only rank 0 holds the bias, so the sum adds it once; the other ranks skip the checkpoint's."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias and tp.rank == 0)
        shard(self, tp, 1)
        self.skipped = ("bias",) if bias and tp.rank else ()


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [rank * n, (rank + 1) * n) of the embedding table: ids outside them give
    zero rows, and the all-reduce fills in the other ranks' rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__(num_embeddings, embedding_dim)
        shard(self, tp, 0)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.tp.rank * self.num_embeddings
        outside = (local < 0) | (local >= self.num_embeddings)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))


def shard(module: nn.Module, tp: TensorParallel | None, dim: int) -> nn.Module:
    """Marks `module`'s parameters as this rank's slice of the checkpoint's along `dim` (those
    with that dim: a row-parallel bias is whole)."""
    if tp is not None:
        module.tp_split = (dim, tp.rank, tp.size)
    return module


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> nn.Linear:
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, backend: TorchAttentionBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                quantize: bool = False) -> tuple[torch.Tensor | Quantized, torch.Tensor | None]:
        """(normed, x + residual); normed quantized per token for an FP8 projection if `quantize`."""
        if quantize:
            return self.backend.rms_norm_quant_fp8(x, self.weight, self.eps, residual)
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend,
                 tp: TensorParallel | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = shard(MergedLinear(config.hidden_size,
                                           {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
                                           bias=config.attention_bias), tp, 0)
        self.o_proj = row_linear(q_size, config.hidden_size, config.o_proj_bias, tp)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
        self.qk_norm = config.qk_norm
        self.scale = self.head_dim ** -0.5
        # The fp8 KV cache's per-layer scales (vLLM's k_scale, v_scale): 1.0 unless the
        # checkpoint has calibrated ones (weight_loader.KV_SCALE_SUFFIXES).
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        self.backend = backend
        self.tp = tp

    def forward(self, positions: torch.Tensor, x: torch.Tensor | Quantized, kv_cache: KVCache,
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
        out = self.o_proj(out.view(-1, self.num_heads * self.head_dim))
        # NCCL's all-reduce is captured in the decode CUDA graphs like the kernels around it.
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend,
                 tp: TensorParallel | None) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = shard(MergedLinear(config.hidden_size, {"gate_proj": size, "up_proj": size},
                                               bias=config.mlp_bias), tp, 0)
        self.down_proj = row_linear(size, config.hidden_size, config.mlp_bias, tp)
        self.backend = backend
        self.tp = tp

    def forward(self, x: torch.Tensor | Quantized, quantize: bool) -> torch.Tensor:
        h = self.gate_up_proj(x)
        h = self.backend.silu_and_mul_quant_fp8(h) if quantize else self.backend.silu_and_mul(h)
        out = self.down_proj(h)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend,
                 tp: TensorParallel | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend, tp)
        self.mlp = MLP(config, backend, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata, cos_sin_cache: torch.Tensor,
                quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the next norm: each norm returns (normed, x + residual).
        # With `quantize` (FP8 projections that quantize their input) the norms and the
        # activation quantize their own output, which saves a pass over it.
        if residual is None:
            residual = x
            x, _ = self.input_layernorm(x, quantize=quantize)
        else:
            x, residual = self.input_layernorm(x, residual, quantize)
        x = self.self_attn(positions, x, kv_cache, meta, cos_sin_cache)
        x, residual = self.post_attention_layernorm(x, residual, quantize)
        return self.mlp(x, quantize), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend, max_positions: int,
                 tp: TensorParallel | None) -> None:
        super().__init__()
        self.embed_tokens = (nn.Embedding(config.vocab_size, config.hidden_size) if tp is None
                             else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp))
        self.layers = nn.ModuleList(DecoderLayer(config, backend, tp)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        cos_sin = build_cos_sin_cache(config.head_dim, max_positions, config.rope_theta,
                                      config.rope_scaling)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        quantize = isinstance(self.layers[0].mlp.down_proj, Fp8Linear) and takes_quantized(x)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta, self.cos_sin_cache, quantize)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face's, with q/k/v fused as `qkv_proj` and gate/up as
    `gate_up_proj`. With tied embeddings there is no `lm_head`; logits use `embed_tokens`.
    `config` holds the shapes of the rank `tp` (None: no tensor parallelism)."""

    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend, max_positions: int,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, backend, max_positions, tp)
        if not config.tie_word_embeddings:
            self.lm_head = shard(nn.Linear(config.hidden_size, config.vocab_size, bias=False), tp, 0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size] (the whole vocabulary on
        every rank: each computes its slice and the ranks all-gather them)."""
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        logits = nn.functional.linear(hidden, head.weight)
        return (logits if self.tp is None else self.tp.all_gather(logits)).float()
