"""FP8 W8A8 (--quantization fp8) on the CPU: the layer against float math, tiny models against
their float32 selves, and FP8 checkpoints (compressed-tensors, quant_method fp8) against
quantization at load of the same weights."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pagedserve import LLM
from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc import fp8
from pagedserve.executor_svc.fp8 import Fp8Linear, quantize_linears
from pagedserve.executor_svc.model_config import load_model_config, model_config_from_dict
from pagedserve.executor_svc.layers.decoder import CausalLM
from pagedserve.executor_svc.layers.linear import MergedLinear
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.weight_loader import load_weights
from pagedserve.kernels.reference import FP8_DTYPE, FP8_MAX, per_token_quant_fp8_ref
from tests.executor_svc.harness import paged_prefill_logits
from tests.tiny_models import llm_greedy, make_tiny_model, mixed_prompts

quant = per_token_quant_fp8_ref
# Phi-3's checkpoints keep q/k/v and gate/up fused.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
               "gate_up_proj")
MIN_COSINE = 0.99


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def tiny(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    # Tied embeddings and q/k/v biases: the shapes that fusing and tying make hardest to load.
    return make_tiny_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("qwen2"))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = MergedLinear(64, {"q_proj": 32, "k_proj": 16, "v_proj": 16}, bias=True)
        # torch's random init, which a MergedLinear skips (the weight loader fills it).
        nn.Linear.reset_parameters(self.qkv_proj)
        self.o_proj = nn.Linear(64, 48, bias=False)
        self.other = nn.Linear(64, 8)


@pytest.mark.parametrize("rows_scaled", [True, False], ids=["scaled_mm", "dequantized"])
def test_fp8_linear_is_fp8_math_and_close_to_float(monkeypatch, rows_scaled):
    # Without a scale a row in the CPU _scaled_mm (torch 2.11), the operands are dequantized.
    if rows_scaled and not fp8.cpu_scaled_mm_takes_rows():
        pytest.skip("this torch's CPU _scaled_mm takes one scale a tensor (torch 2.11's)")
    monkeypatch.setattr(fp8, "cpu_scaled_mm_takes_rows", lambda: rows_scaled)
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 5, 64) * 3
    expected = block.qkv_proj(x)
    w_q, w_scale = quant(block.qkv_proj.weight)
    quantize_linears(block, quant)
    layer = block.qkv_proj
    assert isinstance(layer, Fp8Linear) and isinstance(block.o_proj, Fp8Linear)
    assert type(block.other) is nn.Linear
    assert layer.shards == {"q_proj": (0, 32), "k_proj": (32, 16), "v_proj": (48, 16)}
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (64, 1)
    assert torch.equal(layer.weight.float(), w_q.float())
    out = layer(x)
    x_q, x_scale = quant(x.reshape(-1, 64))
    dequantized = (x_q.float() * x_scale) @ (w_q.float() * w_scale).t() + layer.bias
    assert out.shape == expected.shape
    torch.testing.assert_close(out, dequantized.view(2, 5, 64), rtol=1e-5, atol=1e-5)
    # Two 3-mantissa-bit operands: a few percent.
    assert ((out - expected).norm() / expected.norm()).item() < 0.06


def assert_fp8_keeps_logits(path, min_cosine: float) -> None:
    """The model's prefill logits in FP8 differ from full precision's, with a mean cosine of at
    least `min_cosine`."""
    prompts = mixed_prompts(0)
    full = torch.cat(paged_prefill_logits(path, prompts))
    fp8 = torch.cat(paged_prefill_logits(path, prompts, fp8=True))
    cosine = nn.functional.cosine_similarity(full, fp8, dim=-1)
    assert cosine.mean() >= min_cosine, f"mean cosine {cosine.mean():.4f}"
    assert not torch.equal(full, fp8)


def test_tiny_models_in_fp8_keep_their_logits(tiny):
    assert_fp8_keeps_logits(tiny, MIN_COSINE)


def test_quantized_weights_replace_the_full_precision_ones(qwen2):
    config = load_model_config(qwen2)
    model = build_model(config, TorchAttentionBackend(), 64)
    load_weights(model, qwen2, "auto", quantize=quant)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["model.layers.0.self_attn.qkv_proj.weight"] == FP8_DTYPE
    assert dtypes["model.layers.1.mlp.down_proj.weight"] == FP8_DTYPE
    assert dtypes["model.layers.0.self_attn.qkv_proj.bias"] == torch.float32
    assert dtypes["model.embed_tokens.weight"] == torch.float32
    fp8 = [name for name, dtype in dtypes.items() if dtype == FP8_DTYPE]
    assert len(fp8) == 4 * config.num_hidden_layers


def test_engine_generates_greedily_in_fp8(qwen2):
    """The engine's FP8 decode steps pick what an FP8 prefill over the same context ranks first."""
    prompts = mixed_prompts(1)[:4]
    llm = LLM(str(qwen2), quantization="fp8", max_model_len=256, num_gpu_blocks_override=128, seed=0)
    assert isinstance(llm.worker.model.model.layers[0].mlp.down_proj, Fp8Linear)
    outputs = llm_greedy(llm, prompts, 12)
    contexts = [p + o for p, o in zip(prompts, outputs)]
    logits = paged_prefill_logits(qwen2, contexts, fp8=True)
    agree = sum(int(t == r) for p, o, l in zip(prompts, outputs, logits)
                for t, r in zip(o, l[len(p) - 1:-1].argmax(-1).tolist()))
    assert agree >= 0.95 * 12 * len(prompts)


def per_channel(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale = quant(weight)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor([0.02])}


def per_tensor(weight: torch.Tensor, scale_name: str = "weight_scale", shape: tuple = (1,)) -> dict:
    scale = weight.abs().max().float() / FP8_MAX
    q = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return {"weight": q, scale_name: scale.reshape(shape)}


def compressed_tensors(strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}


def write_fp8_checkpoint(source, target, quant_config: dict, quantize_weight) -> None:
    """The tiny model's checkpoint with each decoder projection's weight in FP8."""
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        module, _, kind = name.rpartition(".")
        if kind == "weight" and module.rpartition(".")[2] in PROJECTIONS:
            tensors.update({f"{module}.{k}": v for k, v in quantize_weight(tensor).items()})
        else:
            tensors[name] = tensor
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": quant_config}))
    shutil.copy(source / "generation_config.json", target)


def loaded(path, quantize=quant) -> CausalLM:
    model = build_model(load_model_config(path), TorchAttentionBackend(), 64)
    load_weights(model, path, "auto", quantize=quantize)
    return model


def test_per_channel_compressed_tensors_checkpoint_equals_quantization_at_load(qwen2, tmp_path):
    write_fp8_checkpoint(qwen2, tmp_path, compressed_tensors("channel"), per_channel)
    assert load_model_config(tmp_path).quantization == "fp8"
    ours, at_load = loaded(tmp_path).state_dict(), loaded(qwen2).state_dict()
    assert ours.keys() == at_load.keys()
    for name, tensor in at_load.items():
        assert torch.equal(ours[name].float(), tensor.float()), name
    prompts = mixed_prompts(2)[:3]
    for a, b in zip(paged_prefill_logits(tmp_path, prompts), paged_prefill_logits(qwen2, prompts, fp8=True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("quant_config, quantize_weight", [
    (compressed_tensors("tensor"), per_tensor),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, lambda w: per_tensor(w, "weight_scale_inv", ())),
], ids=["compressed_tensors_per_tensor", "fp8_weight_scale_inv"])
def test_per_tensor_checkpoints_fuse_shard_scales_exactly(qwen2, tmp_path, quant_config, quantize_weight):
    write_fp8_checkpoint(qwen2, tmp_path, quant_config, quantize_weight)
    model = loaded(tmp_path)
    source = load_file(qwen2 / "model.safetensors")
    qkv = model.model.layers[1].self_attn.qkv_proj
    shards = [quantize_weight(source[f"model.layers.1.self_attn.{p}.weight"]) for p in ("q_proj", "k_proj", "v_proj")]
    expected = torch.cat([s["weight"].float() * s[next(k for k in s if k != "weight")] for s in shards])
    assert torch.equal(qkv.weight.float() * qkv.weight_scale, expected)
    assert torch.equal(qkv.bias, torch.cat([source[f"model.layers.1.self_attn.{p}.bias"]
                                            for p in ("q_proj", "k_proj", "v_proj")]))
    prompts = mixed_prompts(3)
    full = torch.cat(paged_prefill_logits(qwen2, prompts))
    fp8 = torch.cat(paged_prefill_logits(tmp_path, prompts))
    assert nn.functional.cosine_similarity(full, fp8, dim=-1).mean() >= MIN_COSINE


@pytest.mark.parametrize("quant_config, quantize_weight", [
    (compressed_tensors("tensor"), per_tensor), (compressed_tensors("channel"), per_channel),
], ids=["per_tensor", "per_channel"])
def test_fused_checkpoint_tensors_keep_their_scales(tmp_path, quant_config, quantize_weight):
    phi3 = make_tiny_model("Phi3ForCausalLM", tmp_path / "phi3")
    (tmp_path / "fp8").mkdir()
    write_fp8_checkpoint(phi3, tmp_path / "fp8", quant_config, quantize_weight)
    layer = loaded(tmp_path / "fp8").model.layers[1]
    source = load_file(phi3 / "model.safetensors")
    for linear, name in ((layer.self_attn.qkv_proj, "self_attn.qkv_proj"), (layer.mlp.gate_up_proj, "mlp.gate_up_proj")):
        fp8 = quantize_weight(source[f"model.layers.1.{name}.weight"])
        assert torch.equal(linear.weight.float() * linear.weight_scale, fp8["weight"].float() * fp8["weight_scale"])


def test_fp8_checkpoint_with_full_precision_weights_is_refused(qwen2, tmp_path):
    write_fp8_checkpoint(qwen2, tmp_path, compressed_tensors("channel"),
                         lambda w: {"weight": w, "weight_scale": torch.ones(w.shape[0], 1)})
    with pytest.raises(ValueError, match="is torch.float32, not FP8 E4M3"):
        loaded(tmp_path)


LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=4096,
             intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             max_position_embeddings=4096)


@pytest.mark.parametrize("quant_config, says", [
    ({"quant_method": "awq", "bits": 4}, "quantization method 'awq' is not supported; pagedserve loads FP8"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]},
     "block-wise FP8 checkpoints (weight_block_size [128, 128]) are not supported"),
    ({**compressed_tensors("channel"), "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "compressed-tensors weights of type int, 4 bits, strategy group are not supported"),
    ({**compressed_tensors("channel"), "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]},
     "leaves ['model.layers.0.mlp.down_proj'] unquantized"),
])
def test_unsupported_quantization_configs_are_refused(quant_config, says):
    with pytest.raises(ValueError) as refused:
        model_config_from_dict({**LLAMA, "quantization_config": quant_config})
    assert says in str(refused.value)


def test_fp8_checkpoints_need_no_flag(tmp_path):
    for quant_config in (compressed_tensors("tensor"), {"quant_method": "fp8"}):
        assert model_config_from_dict({**LLAMA, "quantization_config": quant_config}).quantization == "fp8"
    assert model_config_from_dict(LLAMA).quantization is None
