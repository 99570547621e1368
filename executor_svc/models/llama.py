"""The Llama family: Llama 2/3/3.1, Mistral, TinyLlama, SmolLM, Qwen2 (qkv bias), Qwen3 (q/k
norm), Phi-3/3.5/4 (checkpoints with q/k/v and gate/up fused, longrope, partial rotary); the
config's flags (model_config) pick the biases and the q/k norms. Every layer alike but for its
sliding window: attention and a gated MLP behind RMSNorms, one rotary table."""
from functools import partial

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.layers.attention import Attention, layer_windows, with_layer_types
from pagedserve.executor_svc.layers.decoder import CausalLM, DecoderLayer
from pagedserve.executor_svc.layers.mlp import GatedMLP
from pagedserve.executor_svc.layers.norm import RMSNorm
from pagedserve.executor_svc.layers.rotary import RotaryEmbedding
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.parallel import TensorParallel


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend, max_positions: int,
                 tp: TensorParallel | None = None) -> None:
        rotary = RotaryEmbedding(config.rope, max_positions)
        norm = partial(RMSNorm, eps=config.rms_norm_eps, backend=backend)
        windows = layer_windows(config)

        def layer(index: int) -> DecoderLayer:
            attention = Attention(config, backend, tp, norm, sliding_window=windows[index])
            return DecoderLayer(config, attention, GatedMLP(config, backend, tp), norm)
        super().__init__(config, tp, layer, norm, rotary)

    @staticmethod
    def read_hf_config(config: dict) -> dict:
        """config.json with Qwen2's and Qwen3's `layer_types` spelled out: transformers slides the
        layers from max_window_layers on (when use_sliding_window; model_config reads that)."""
        if config["architectures"][0] not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            return config
        limit = config.get("max_window_layers", 28)
        return with_layer_types(config, lambda i: i >= limit)
