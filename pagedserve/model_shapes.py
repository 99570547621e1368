"""Named model shapes for benchmarks with dummy weights (`--model-config NAME --load-format dummy`)."""
import json
import tempfile
from pathlib import Path

SHAPES = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16",
        bos_token_id=128000, eos_token_id=128001,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
}


def write_shape(name: str) -> str:
    """Writes a config-only model directory for `name` and returns its path."""
    if name not in SHAPES:
        raise ValueError(f"unknown model config {name!r}; known: {', '.join(SHAPES)}")
    path = Path(tempfile.mkdtemp(prefix=f"pagedserve-{name}-"))
    (path / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    return str(path)
