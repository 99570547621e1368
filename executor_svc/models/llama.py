"""The Llama family: Llama 2/3/3.1, Mistral, TinyLlama, SmolLM, Qwen2 (qkv bias), Qwen3 (q/k
norm); the config's flags (model_config) pick the biases and the q/k norms. Every layer alike:
attention and a gated MLP behind RMSNorms, one rotary table."""
from functools import partial

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.layers.attention import Attention
from pagedserve.executor_svc.layers.decoder import CausalLM, DecoderLayer
from pagedserve.executor_svc.layers.mlp import GatedMLP
from pagedserve.executor_svc.layers.norm import RMSNorm
from pagedserve.executor_svc.layers.rotary import RotaryEmbedding
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.parallel import TensorParallel


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, backend: TorchAttentionBackend, max_positions: int,
                 tp: TensorParallel | None = None) -> None:
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        norm = partial(RMSNorm, eps=config.rms_norm_eps, backend=backend)

        def layer(index: int) -> DecoderLayer:
            return DecoderLayer(config, Attention(config, backend, tp, norm), GatedMLP(config, backend, tp), norm)
        super().__init__(config, tp, layer, norm, rotary)
