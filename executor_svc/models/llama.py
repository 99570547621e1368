"""The Llama family: Llama 2/3/3.1, Mistral, TinyLlama, SmolLM, Qwen2 (qkv bias), Qwen3 (q/k
norm), Phi-3/3.5/4 (checkpoints with q/k/v and gate/up fused, longrope, partial rotary); the
config's flags (model_config) pick the biases and the q/k norms. Every layer alike but for its
sliding window: attention and a gated MLP behind RMSNorms, one rotary table."""
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
        rotary = RotaryEmbedding(config.rope, max_positions)
        norm = partial(RMSNorm, eps=config.rms_norm_eps, backend=backend)
        windows = layer_windows(config)

        def layer(index: int) -> DecoderLayer:
            attention = Attention(config, backend, tp, norm, sliding_window=windows[index])
            return DecoderLayer(config, attention, GatedMLP(config, backend, tp), norm)
        super().__init__(config, tp, layer, norm, rotary)


def layer_windows(config: ModelConfig) -> list[int | None]:
    """Each layer's sliding window, as transformers applies them: to the layers `layer_types`
    marks sliding in the families whose attention reads it (QWEN_SLIDING_LAYERS gives transformers'
    default), to every layer in the others (Mistral, Phi-3, Mixtral, Qwen3-MoE).
    config.sliding_window is None unless a Qwen config sets `use_sliding_window`."""
    layers, window, hf = config.num_hidden_layers, config.sliding_window, config.hf_config
    sliding = QWEN_SLIDING_LAYERS.get(config.architecture)
    if window is None or sliding is None:
        return [window] * layers
    types = hf.get("layer_types") or ["sliding_attention" if sliding(i, hf.get("max_window_layers", 28))
                                      else "full_attention" for i in range(layers)]
    return [window if kind == "sliding_attention" else None for kind in types]


# transformers' sliding layers (index, max_window_layers) of the Qwen families whose config.json
# has no `layer_types`: Qwen2's and Qwen3's from max_window_layers on, Qwen2-MoE's the even-indexed
# ones below it.
QWEN_SLIDING_LAYERS = {"Qwen2ForCausalLM": lambda i, limit: i >= limit,
                       "Qwen3ForCausalLM": lambda i, limit: i >= limit,
                       "Qwen2MoeForCausalLM": lambda i, limit: i % 2 == 0 and i < limit}
