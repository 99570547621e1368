"""The decoder stack every family shares: layers of attention then an MLP-like block, each
behind a norm with the residual add fused in, between the embedding and the LM head.

Tokens arrive flattened ([T], sequences packed one after another). Under tensor parallelism
(`tp`) the config holds one rank's shapes (parallel.shard_config); the embedding and LM head are
vocab parallel, and each rank's logits slice is all-gathered."""
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import nn

from pagedserve.executor_svc.attention_backend import AttentionMetadata, first_rows, with_rows
from pagedserve.executor_svc.fp8 import Fp8Linear, takes_quantized
from pagedserve.executor_svc.kv_cache import KVCache
from pagedserve.executor_svc.layers.attention import Attention
from pagedserve.executor_svc.layers.linear import (CheckpointLinear, Linear, MergedLinear, NarrowHead, embedding,
                                                   input_rows, shard)
from pagedserve.executor_svc.layers.mlp import GatedMLP
from pagedserve.executor_svc.layers.norm import Norm, RMSNorm
from pagedserve.executor_svc.layers.rotary import RotaryEmbedding
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.parallel import TensorParallel

T = TypeVar("T")


class DecoderLayer(nn.Module):
    """`self_attn` (layers.attention.Attention or one like it) and `mlp` (a GatedMLP, or any
    block called as mlp(x, quantize) with a `quantized_input` flag and an `input_rows(T)`, e.g. a
    mixture of experts), each after a norm that `norm` builds."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module, norm: Norm) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm(config.hidden_size)
        self.post_attention_layernorm = norm(config.hidden_size)
        # A plain attribute: a submodule's would cost a Module.__getattr__ per layer and step.
        self.quantize_mlp_input = mlp.quantized_input
        # Set by fold_norms: the norms' weights live in the projections after them.
        self.folded = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata, cos_sin_cache: torch.Tensor,
                quantize: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.folded:
            # x is the residual stream (residual is None throughout), updated in place.
            num_tokens = len(positions)
            self.self_attn.accumulate(positions, x, num_tokens, kv_cache, meta, cos_sin_cache,
                                      self.input_layernorm.eps)
            self.mlp.accumulate(x, num_tokens, self.post_attention_layernorm.eps)
            return x, None
        x, residual = self.attend(positions, x, residual, kv_cache, meta, cos_sin_cache, quantize)
        num_tokens = len(residual)
        x, residual = self.post_attention_layernorm(x, residual, quantize and self.quantize_mlp_input,
                                                    self.mlp.input_rows(num_tokens))
        return first_rows(self.mlp(x, quantize), num_tokens), residual

    def attend(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
               kv_cache: KVCache, meta: AttentionMetadata, cos_sin_cache: torch.Tensor,
               quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention's output, x + residual): the input norm, then attention."""
        # The residual add is fused into the next norm: each norm returns (normed, x + residual).
        # With `quantize` (FP8 projections that quantize their input) the norms and the
        # activation quantize their own output, which saves a pass over it.
        if residual is None:
            residual = x
            x, _ = self.input_layernorm(x, quantize=quantize)
        else:
            x, residual = self.input_layernorm(x, residual, quantize)
        return self.self_attn(positions, x, kv_cache, meta, cos_sin_cache), residual


class DecoderModel(nn.Module):
    """The embedding, `config.num_hidden_layers` layers built by `make_layer(index)` (a model
    whose layers differ, such as a sliding window on some, says so there), the final norm, and
    the rotary table every layer's attention rotates with. A model with a table per layer kind
    (Gemma 3's local and global ones) overrides forward to hand each layer its own."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None, make_layer: Callable[[int], nn.Module],
                 norm: Norm, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = norm(config.hidden_size)
        self.rotary_emb = rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        cos_sin_caches = [self.rotary_emb.cos_sin_cache] * len(self.layers)
        return self.decode(self.embed_tokens(input_ids), positions, kv_caches, meta, cos_sin_caches)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
               meta: AttentionMetadata, cos_sin_caches: list[torch.Tensor]) -> torch.Tensor:
        """The layers and the final norm over the embedded tokens `x`; layer i rotates q and k
        by cos_sin_caches[i]."""
        residual = None
        quantize = isinstance(self.layers[0].self_attn.o_proj, Fp8Linear) and takes_quantized(x)
        num_tokens = len(x)
        if self.layers[0].folded:
            # o_proj and down_proj add into the stream: on its rows, which they run faster on.
            x = with_rows(x, input_rows(self.layers[0].self_attn.o_proj, num_tokens))
        for layer, kv_cache, cos_sin_cache in zip(self.layers, kv_caches, cos_sin_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta, cos_sin_cache, quantize)
        return self.norm(x[:num_tokens], residual)[0]


class CausalLM(nn.Module):
    """A DecoderModel and its LM head: what every family's model is. Parameter names follow
    Hugging Face's, with q/k/v fused as `qkv_proj` and gate/up as `gate_up_proj`. With tied
    embeddings there is no `lm_head`; logits use `embed_tokens`. `config` holds the shapes of the
    rank `tp` (None: no tensor parallelism).

    A family subclasses it with __init__(config, backend, max_positions, tp), the signature
    models.build_model calls, and passes up how to build its layers and norms, and its rotary
    table; `decoder_model` is the class of its stack."""
    decoder_model: type[DecoderModel] = DecoderModel

    def __init__(self, config: ModelConfig, tp: TensorParallel | None, make_layer: Callable[[int], nn.Module],
                 norm: Norm, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = self.decoder_model(config, tp, make_layer, norm, rotary)
        if not config.tie_word_embeddings:
            self.lm_head = shard(CheckpointLinear(config.hidden_size, config.vocab_size, bias=False), tp, 0)
        # Set by the worker where it narrows the projections (executor_svc/worker.py).
        self.narrow_head: NarrowHead | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in the head's output dtype (the model
        dtype, float32 from the narrow head; the whole vocabulary on every rank: each computes its
        slice and the ranks all-gather them). Whoever edits or normalizes them widens them first."""
        if self.narrow_head is not None:
            logits = self.narrow_head(hidden)
        else:
            logits = nn.functional.linear(hidden, self.head_weight())
        return logits if self.tp is None else self.tp.all_gather(logits)

    def head_weight(self) -> torch.Tensor:
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return head.weight

    @staticmethod
    def read_hf_config(config: dict) -> dict:
        """config.json as this family's transformers class reads it (its defaults filled in, its
        own key names), from which model_config builds the ModelConfig."""
        return config

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, T]]) -> Iterable[tuple[str, T]]:
        """The checkpoint's (name, tensor) pairs as this model's parameters take them: a family
        whose checkpoints name or store a weight otherwise renames or converts it here."""
        return tensors


def fold_norms(model: CausalLM) -> bool:
    """Folds each layer's two RMSNorm weights into the projections after them (W * diag(weight)),
    where every layer is a plain DecoderLayer of unsharded model-dtype projections, without
    biases but qkv's (Qwen2's, which rotary then adds: Attention.folded_bias), on a backend whose
    kernels scale by the norm (`folds_norms`), and heads rotate whole where there are q/k norms
    or a qkv bias: each layer then runs without its norm kernels, its projections reading the
    residual stream, rotary and the activation scaling by its 1 / RMS (q/k norms, as Qwen3's,
    then norm the scaled heads), and o_proj and down_proj adding into the stream. Returns whether
    it folded."""
    layers = model.model.layers
    if not all(_foldable(layer) for layer in layers):
        return False
    partial = model.model.rotary_emb.cos_sin_cache.shape[1] != layers[0].self_attn.head_dim
    if partial and any(layer.self_attn.qk_norm or layer.self_attn.qkv_proj.bias is not None for layer in layers):
        # Rotary norms and biases whole heads only.
        return False
    for layer in layers:
        _fold(layer.input_layernorm, layer.self_attn.qkv_proj)
        _fold(layer.post_attention_layernorm, layer.mlp.gate_up_proj)
        _keep_bias_out(layer.self_attn)
        layer.folded = True
    return True


def _keep_bias_out(attn: Attention) -> None:
    # The bias goes on after the norm, which the folded GEMM no longer has applied.
    bias = attn.qkv_proj.bias
    if bias is not None:
        attn.folded_bias = tuple(bias.data.split([heads * attn.head_dim for heads in attn.heads]))
        attn.qkv_proj.bias = None


def _foldable(layer: nn.Module) -> bool:
    if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not GatedMLP:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    projections = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
    return (attn.backend.folds_norms and attn.tp is None and mlp.tp is None
            and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and all(type(p) in (Linear, MergedLinear) for p in projections)
            and all(p.bias is None for p in projections[1:]))


def _fold(norm: RMSNorm, projection: Linear) -> None:
    # One rounding, as torch multiplies bf16 in fp32.
    projection.weight.data.mul_(norm.weight.to(projection.weight.dtype))
