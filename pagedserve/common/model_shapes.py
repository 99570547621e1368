"""Named model shapes for benchmarks with dummy weights (`--model-config NAME --load-format dummy`)."""
import json
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SHAPES = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16",
        bos_token_id=128000, eos_token_id=128001,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
    # Qwen/Qwen3-8B's config.json: q/k norms.
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, torch_dtype="bfloat16", attention_bias=False, hidden_act="silu",
        bos_token_id=151643, eos_token_id=151645, max_window_layers=36, sliding_window=None,
        use_sliding_window=False),
    # Qwen/Qwen2.5-7B-Instruct's config.json: a qkv bias.
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        torch_dtype="bfloat16", hidden_act="silu", bos_token_id=151643, eos_token_id=151645,
        max_window_layers=28, sliding_window=131072, use_sliding_window=False),
    # Qwen/Qwen3-30B-A3B's config.json: 128 experts of width 768, 8 a token, in every layer.
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16", attention_bias=False,
        hidden_act="silu", bos_token_id=151643, eos_token_id=151645, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_window_layers=48, sliding_window=None, use_sliding_window=False),
    # microsoft/Phi-3-mini-4k-instruct's config.json: fused qkv/gate_up checkpoints, head_dim 96,
    # a 2047-token sliding window on every layer.
    "phi-3-mini": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32064, hidden_size=3072,
        intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, original_max_position_embeddings=4096, rope_theta=10000.0,
        rope_scaling=None, sliding_window=2047, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=32000,
        pad_token_id=32000),
    # microsoft/Phi-4-mini-instruct's config.json less its longrope factors, which change no shape:
    # partial rotary (96 of 128 dims).
    "phi-4-mini": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=200064, hidden_size=3072,
        intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
        partial_rotary_factor=0.75, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rope_theta=10000.0, rope_scaling=None,
        sliding_window=262144, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True,
        torch_dtype="bfloat16", bos_token_id=199999, eos_token_id=199999, pad_token_id=199999),
    # google/gemma-2-9b-it's config.json (tie_word_embeddings is transformers' default there).
    "gemma-2-9b": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000, hidden_size=3584,
        intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, max_position_embeddings=8192, rope_theta=10000.0,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        attention_bias=False, tie_word_embeddings=True, torch_dtype="bfloat16", bos_token_id=2,
        eos_token_id=1, pad_token_id=0),
    # BAAI/bge-m3's config.json (XLM-RoBERTa large: 8192 positions past the padding id's 2). Its
    # checkpoint is float32, which --dtype auto keeps on a GPU (vLLM's auto halves it): pass
    # --dtype bfloat16.
    "bge-m3": dict(
        architectures=["XLMRobertaModel"], model_type="xlm-roberta", vocab_size=250002, hidden_size=1024,
        intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, max_position_embeddings=8194,
        type_vocab_size=1, layer_norm_eps=1e-5, hidden_act="gelu", position_embedding_type="absolute",
        torch_dtype="float32", bos_token_id=0, eos_token_id=2, pad_token_id=1),
    # BAAI/bge-reranker-v2-m3's: the same encoder with RoBERTa's one-label classification head.
    "bge-reranker-v2-m3": dict(
        architectures=["XLMRobertaForSequenceClassification"], model_type="xlm-roberta", vocab_size=250002,
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        max_position_embeddings=8194, type_vocab_size=1, layer_norm_eps=1e-5, hidden_act="gelu",
        position_embedding_type="absolute", torch_dtype="float32", bos_token_id=0, eos_token_id=2,
        pad_token_id=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}),
}


def write_shape(name: str, path: str | None = None, tokenizer: bool = False) -> str:
    """Writes a model directory for `name` with a config and no weights (serve it with
    `--load-format dummy`); returns its path. With `tokenizer`, it also gets a synthetic word-level
    tokenizer covering the whole vocabulary, so that a server can stream text for every token."""
    if name not in SHAPES:
        raise ValueError(f"unknown model config {name!r}; known: {', '.join(SHAPES)}")
    out = Path(path) if path else Path(tempfile.mkdtemp(prefix=f"pagedserve-{name}-"))
    out.mkdir(parents=True, exist_ok=True)
    config = SHAPES[name]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        write_tokenizer(out, config["vocab_size"])
    return str(out)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json in `path`: token i is the word `w{i}`."""
    # Real weights would come with their real tokenizer; this one only has to decode every id.
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
