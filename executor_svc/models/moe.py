"""The mixture-of-experts families: Qwen3-MoE (q/k norm), Qwen2-MoE (q/k/v biases, a shared
expert) and Mixtral (Mistral's attention). Llama's decoder with a sparse MoE block
(layers.moe) in place of the MLP, on every layer or, for Qwen, on those config.json's
`mlp_only_layers` and `decoder_sparse_step` make sparse."""
from collections.abc import Iterable, Iterator
from dataclasses import replace
from functools import partial

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.layers.attention import Attention, layer_windows, with_layer_types
from pagedserve.executor_svc.layers.decoder import CausalLM, DecoderLayer, T
from pagedserve.executor_svc.layers.mlp import GatedMLP
from pagedserve.executor_svc.layers.moe import SparseMoeBlock, moe_shape
from pagedserve.executor_svc.layers.norm import RMSNorm
from pagedserve.executor_svc.layers.rotary import RotaryEmbedding
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.parallel import TensorParallel


class MoeForCausalLM(CausalLM):
    """Qwen2-MoE and Qwen3-MoE; Mixtral by the subclass below. Routing renormalizes a token's
    top-k weights as config.json's `norm_topk_prob` says, unless the class fixes it."""
    renormalize: bool | None = None

    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend, max_positions: int,
                 tp: TensorParallel | None = None) -> None:
        rotary = RotaryEmbedding(config.rope, max_positions)
        norm = partial(RMSNorm, eps=config.rms_norm_eps, backend=backend)
        attention = attention_config(config)
        shape = moe_shape(config, tp, self.renormalize)
        windows = layer_windows(config)

        def layer(index: int) -> DecoderLayer:
            mlp = (SparseMoeBlock(config, shape, backend, tp) if sparse_layer(config.hf_config, index)
                   else GatedMLP(config, backend, tp))
            return DecoderLayer(config, Attention(attention, backend, tp, norm, windows[index]), mlp, norm)
        super().__init__(config, tp, layer, norm, rotary)

    @staticmethod
    def read_hf_config(config: dict) -> dict:
        """config.json with Qwen2-MoE's `layer_types` spelled out: transformers slides the even
        layers below max_window_layers (when use_sliding_window; model_config reads that)."""
        if config["architectures"][0] != "Qwen2MoeForCausalLM":
            return config
        limit = config.get("max_window_layers", 28)
        return with_layer_types(config, lambda i: i % 2 == 0 and i < limit)


class MixtralForCausalLM(MoeForCausalLM):
    renormalize = True

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, T]]) -> Iterator[tuple[str, T]]:
        """The tensors under this model's names: each MIXTRAL_RENAMES part of a name replaced."""
        for name, tensor in tensors:
            for old, new in MIXTRAL_RENAMES.items():
                name = name.replace(old, new)
            yield name, tensor


# Mixtral's checkpoints name the MoE block and its experts' gate, down and up projections
# otherwise; transformers renames them to these names too.
MIXTRAL_RENAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w2.": ".down_proj.", ".w3.": ".up_proj."}


def sparse_layer(config: dict, index: int) -> bool:
    """Whether layer `index` has the MoE block rather than a dense MLP: transformers' rule."""
    return (index not in config.get("mlp_only_layers", ())
            and (index + 1) % config.get("decoder_sparse_step", 1) == 0)


def attention_config(config: ModelConfig) -> ModelConfig:
    """The config the attention reads: Qwen3-MoE normalizes q and k per head, Qwen2-MoE adds
    biases to q, k and v (its `qkv_bias`, which transformers 4 did not write: always on)."""
    if config.architecture == "Qwen3MoeForCausalLM":
        return replace(config, qk_norm=True)
    if config.architecture == "Qwen2MoeForCausalLM":
        return replace(config, attention_bias=config.hf_config.get("qkv_bias", True), o_proj_bias=False)
    return config
