"""The gated activations a model's `hidden_act` may name: act(gate) * up, as the attention
backend's kernel of that name, and its variant that quantizes the product per token for an FP8
down_proj. The model config refuses any other hidden_act."""

ACTIVATIONS = {"silu": ("silu_and_mul", "silu_and_mul_quant_fp8"),
               "gelu_pytorch_tanh": ("gelu_tanh_and_mul", "gelu_tanh_and_mul_quant_fp8")}
