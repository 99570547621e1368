"""The built-in demo model: a small Llama with deterministic random weights and a real byte-level
BPE tokenizer with a Llama-3-style chat template. Built on first use and cached."""
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VERSION = "v1"
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CORPUS = """\
PagedAttention stores the key and value cache of every request in fixed-size blocks, the way an
operating system pages virtual memory. A block table maps each request's logical blocks to physical
ones, so memory is allocated on demand and almost nothing is wasted. Continuous batching admits new
requests at every step instead of waiting for a whole batch to finish. The scheduler decides which
requests run; the executor runs the model on the GPU and returns one sampled token per request.
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14.
Bonjour, ça va ? Größe, naïve café, déjà vu. 日本語のテキスト。中文文本。Привет, мир!
Emoji travel across tokens: 🙂 🚀 🎉 👍🏽 ❤️ 🇫🇷 — and code: def add(a, b): return a + b
"""
SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=2048)


def default_dir() -> Path:
    root = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))
    return root / f"demo-model-{VERSION}"


def ensure_demo_model(path: Path | None = None) -> Path:
    """Returns the demo model's directory, building it there first if it is not complete."""
    path = Path(path) if path else default_dir()
    if (path / "model.safetensors").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".demo-"))
    write_demo_model(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_demo_model(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    bos, eos = tokenizer.token_to_id("<|begin_of_text|>"), tokenizer.token_to_id("<|eot_id|>")
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab_size,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=bos, eos_token_id=eos, hidden_act="silu", torch_dtype="float32",
                  dtype="float32", **SHAPE)
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", dict(bos_token_id=bos, eos_token_id=[eos]))
    _write_json(path / "tokenizer_config.json", dict(
        bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", add_bos_token=True,
        chat_template=CHAT_TEMPLATE, model_max_length=SHAPE["max_position_embeddings"],
        tokenizer_class="PreTrainedTokenizerFast"))
    save_file(_random_weights(config), str(path / "model.safetensors"), metadata={"format": "pt"})


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    return tokenizer


def _random_weights(config: dict) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    weights = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": rand(v, h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        weights |= {p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                    p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                    p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                    p + "mlp.down_proj.weight": rand(h, i), p + "input_layernorm.weight": torch.ones(h),
                    p + "post_attention_layernorm.weight": torch.ones(h)}
    return weights


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
