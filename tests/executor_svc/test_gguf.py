"""GGUF loading on tiny random models converted as llama.cpp's converter would: config from
metadata, weights equal to the Hugging Face checkpoint's (q/k un-permuted for llama), greedy
tokens equal to transformers', quantized tensors within their type's error, and clear errors."""
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from pagedserve import LLM
from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.gguf_file import ARCHITECTURES, TORCH_DEQUANTIZERS, find_gguf
from pagedserve.executor_svc.model_config import load_model_config
from pagedserve.executor_svc.layers.decoder import CausalLM
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.layers.rotary import cos_sin_cache
from pagedserve.executor_svc.weight_loader import checkpoint_targets, load_weights
from tests.tiny_gguf import Q, write_gguf
from tests.tiny_models import hf_greedy, llm_greedy, make_tiny_model, mixed_prompts

# Phi-3 with longrope, partial rotary and a window (tiny_models), its projections fused.
ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=ARCHS)
def hf_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


def loaded(path) -> CausalLM:
    model = build_model(load_model_config(path), TorchAttentionBackend(), 64)
    load_weights(model, path, "auto")
    return model


def test_config_from_metadata_equals_config_json(hf_dir, tmp_path):
    expected = load_model_config(hf_dir)
    config = load_model_config(write_gguf(hf_dir, tmp_path / "model.gguf"))
    # The raw configs differ (a GGUF file has no config.json of its own); the fields read from them agree.
    assert replace(config, rope=None, hf_config={}) == replace(expected, rope=None, hf_config={})
    # Llama 3.1 scaling arrives as llama.cpp's per-frequency divisors: the same rope table.
    cos_sin, expected_cos_sin = (cos_sin_cache(c.rope, 64) for c in (config, expected))
    torch.testing.assert_close(cos_sin, expected_cos_sin, rtol=0, atol=1e-6)


def test_llama_rope_scaling_survives_conversion(llama_dir, tmp_path):
    config = load_model_config(write_gguf(llama_dir, tmp_path / "model.gguf"))
    assert config.rope.scaling["rope_type"] == "llama3"
    assert config.rope.scaling["freq_factors"][0] == 1.0 and config.rope.scaling["freq_factors"][-1] == 8.0


@pytest.mark.parametrize("outtype", [Q.F32, Q.F16], ids=["F32", "F16"])
def test_weights_equal_the_hf_checkpoint(hf_dir, tmp_path, outtype):
    expected = loaded(hf_dir).state_dict()
    weights = loaded(write_gguf(hf_dir, tmp_path / "model.gguf", outtype)).state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        # The converter keeps 1-D tensors (norms, biases) and MoE routers in F32 whatever the outtype.
        kept = tensor.dim() == 1 or name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight"))
        exact = tensor if kept or outtype == Q.F32 else tensor.half().float()
        assert torch.equal(weights[name], exact), name


def test_greedy_tokens_equal_transformers(hf_dir, tmp_path):
    prompts = mixed_prompts(0)
    # Exact equality holds for float32 on the CPU; a GPU's kernels may flip a near tie of this
    # random model (Qwen3 did on the H200 at its 13th token).
    llm = LLM(str(write_gguf(hf_dir, tmp_path / "model.gguf")), enable_prefix_caching=False, device="cpu",
              dtype="float32")
    assert llm_greedy(llm, prompts, NEW_TOKENS) == hf_greedy(hf_dir, prompts, NEW_TOKENS)


def test_a_directory_with_one_gguf_serves_it(llama_dir, tmp_path):
    write_gguf(llama_dir, tmp_path / "llama.gguf")
    assert find_gguf(tmp_path) == tmp_path / "llama.gguf"
    assert find_gguf(llama_dir) is None
    write_gguf(llama_dir, llama_dir / "extra.gguf")
    assert find_gguf(llama_dir) is None, "a directory with config.json stays a Hugging Face one"
    write_gguf(llama_dir, tmp_path / "other.gguf")
    with pytest.raises(ValueError, match=r"holds 2 .gguf files \(llama.gguf, other.gguf\)"):
        find_gguf(tmp_path)


@pytest.mark.parametrize("qtype, max_step", [(Q.Q8_0, 1 / 127), (Q.Q4_0, 1 / 8), (Q.Q4_1, 1 / 15)],
                         ids=["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_tensors_load_within_their_error(llama_dir, tmp_path, qtype, max_step):
    # A quantization step is a block's largest magnitude over 127 (Q8_0) or 8 (Q4_0), or its
    # range over 15 (Q4_1); rounding to the nearest step errs by at most half of one, Q4_0's
    # clamped top level by one.
    names = {"blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             # Un-permuted after dequantizing: a row left in llama.cpp's order would err by far more.
             "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight"}
    path = write_gguf(llama_dir, tmp_path / "model.gguf", quantize=dict.fromkeys(names, qtype))
    targets = checkpoint_targets(loaded(path))
    original = load_file(llama_dir / "model.safetensors")
    for hf_name in names.values():
        expected = torch.from_numpy(original[hf_name])
        error = (targets[hf_name].view - expected).abs().max().item()
        assert 0 < error <= expected.abs().max().item() * max_step * 1.01, hf_name


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=["Q8_0", "Q4_1"])
def test_torch_dequantizes_as_gguf_py(qtype):
    # Any bytes, NaN and infinite scales among them: the same float32 values.
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (6, 4 * type_size), dtype=np.uint8)
    values = TORCH_DEQUANTIZERS[qtype](torch.from_numpy(raw).view(-1, type_size)).view(6, -1)
    np.testing.assert_array_equal(values.numpy(), gguf.quants.dequantize(raw, qtype))


def test_unsupported_architecture_is_named(llama_dir, tmp_path):
    path = write_gguf(llama_dir, tmp_path / "model.gguf", arch="mamba")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'mamba' in .*model.gguf: "
                                         rf"pagedserve runs {', '.join(ARCHITECTURES)}$"):
        load_model_config(path)


def test_unsupported_tensor_type_is_named(llama_dir, tmp_path):
    path = write_gguf(llama_dir, tmp_path / "model.gguf",
                      retype={"output_norm.weight": np.ones(64, dtype=np.int32)})
    with pytest.raises(ValueError, match="GGUF tensor output_norm.weight has type I32, which "
                                         "pagedserve cannot dequantize"):
        loaded(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_f16_gguf_serves_in_float16_on_a_gpu(llama_dir, tmp_path):
    """Each greedy token of ours is transformers' float32 argmax given the same context, for 95%
    of them (a float16 rounding may flip a near-tie, as test_gpu_parity explains)."""
    prompts = mixed_prompts(0)
    llm = LLM(str(write_gguf(llama_dir, tmp_path / "model.gguf", Q.F16)), device="cuda",
              max_model_len=256, enable_prefix_caching=False)
    assert llm.worker.dtype == torch.float16
    tokens = llm_greedy(llm, prompts, NEW_TOKENS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).cuda()
    agreed = 0
    with torch.inference_mode():
        for prompt, ours in zip(prompts, tokens):
            logits = hf(torch.tensor([prompt + ours], device="cuda")).logits[0, len(prompt) - 1:-1]
            agreed += sum(a == b for a, b in zip(logits.argmax(-1).tolist(), ours))
    assert agreed >= 0.95 * len(prompts) * NEW_TOKENS
