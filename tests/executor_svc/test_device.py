"""The CPU executor's thread count, the dtype of the decoder's linear weights, and projections whose
weights are narrower than their activations."""
import copy
import dataclasses

import pytest
import torch

from pagedserve.executor_svc import device
from pagedserve.executor_svc.device import cap_cpu_threads, cpu_computes_bf16, resolve_linear_dtype
from pagedserve.executor_svc.layers.linear import (HEAD_INT8_MAX_ROWS, INT4_MAX_ROWS, Linear, NarrowHead, int4_grid,
                                                   narrow_linears, packed_linear)
from pagedserve.executor_svc.model_config import load_model_config
from tests.tiny_models import make_tiny_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# Narrowed projections run oneDNN's bfloat16 inner product, which an AVX2-only CPU refuses; the
# product narrows only where the CPU computes in bfloat16 natively (resolve_linear_dtype).
native_bf16 = pytest.mark.skipif(not cpu_computes_bf16(),
                                 reason="narrowed projections need a CPU with native bfloat16")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return load_model_config(make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("m")))


@pytest.mark.parametrize("native", [True, False])
def test_auto_narrows_a_half_precision_checkpoint_on_a_bf16_cpu(monkeypatch, config, native):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    half = dataclasses.replace(config, dtype="float16")
    expected = torch.bfloat16 if native else torch.float32
    assert resolve_linear_dtype("auto", half, CPU, torch.float32) == expected


@pytest.mark.parametrize("name, dtype, checkpoint, device, quantization", [
    ("float32", torch.float32, "float16", CPU, None),    # --dtype float32: the exact path
    ("auto", torch.float32, "float32", CPU, None),       # a float32 checkpoint
    ("auto", torch.float32, "bfloat16", CPU, "fp8"),     # quantized
    ("auto", torch.bfloat16, "bfloat16", CUDA, None),    # a GPU
])
def test_linear_weights_keep_the_model_dtype(monkeypatch, config, name, dtype, checkpoint, device,
                                             quantization):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    model = dataclasses.replace(config, dtype=checkpoint)
    assert resolve_linear_dtype(name, model, device, dtype, quantization) == dtype


@native_bf16
def random_linear(in_features: int, out_features: int) -> Linear:
    """A Linear with torch's random init, which the class skips (the weight loader fills it)."""
    layer = Linear(in_features, out_features)
    torch.nn.Linear.reset_parameters(layer)
    return layer


def test_narrowed_linear_takes_and_gives_float32():
    torch.manual_seed(0)
    model = torch.nn.Sequential(random_linear(64, 32), torch.nn.Linear(32, 8))
    x = torch.randn(5, 64)
    expected = model[0](x)
    narrow_linears(model, torch.bfloat16)
    assert model[0].weight.dtype == model[0].bias.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32
    out = model[0](x)
    assert out.dtype == torch.float32
    assert torch.allclose(out, expected, atol=0.05) and not torch.equal(out, expected)


@native_bf16
@pytest.mark.parametrize("rows", [1, HEAD_INT8_MAX_ROWS, HEAD_INT8_MAX_ROWS + 3])
def test_narrow_head_gives_float32_logits_near_each_rows_greatest(monkeypatch, rows):
    int8_mm, calls = torch._weight_int8pack_mm, []
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *args: calls.append(args) or int8_mm(*args))
    torch.manual_seed(0)
    weight = torch.randn(4096, 64)
    hidden = torch.randn(rows, 64) * 4
    exact = hidden @ weight.T
    logits = NarrowHead(weight)(hidden)
    assert bool(calls) == (rows <= HEAD_INT8_MAX_ROWS)
    assert logits.dtype == torch.float32
    near = exact >= exact.amax(-1, keepdim=True) - 1
    assert torch.allclose(logits[near], exact[near], rtol=0, atol=1e-4)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    far = ~near & (logits - exact).abs().gt(1e-3)
    assert far.any() and (logits - exact).abs().max() < 0.01 * exact.abs().max()


def q4_grid_weight(n: int, k: int) -> torch.Tensor:
    """A weight as a Q4_1 GGUF holds it: per group of 32 inputs, low + code * step for codes 0-15,
    each group using both ends."""
    codes = torch.randint(0, 16, (n, k // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15
    low, step = torch.randn(n, k // 32, 1) * 0.05, torch.rand(n, k // 32, 1) * 0.01 + 0.001
    return (low + codes * step).reshape(n, k)


@native_bf16
def test_a_4_bit_grid_runs_the_int4_kernel_at_few_rows_and_bfloat16_at_many():
    torch.manual_seed(0)
    layer = random_linear(128, 64)
    with torch.no_grad():
        layer.weight.copy_(q4_grid_weight(64, 128))
    model = torch.nn.Sequential(copy.deepcopy(layer), random_linear(128, 64))
    narrow_linears(model, torch.bfloat16)
    assert model[0].int4 is not None and model[1].int4 is None
    for rows in (1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1):
        x = torch.randn(rows, 128)
        out = model[0](x)
        assert out.dtype == torch.float32
        assert torch.allclose(out, layer(x), rtol=0.02, atol=0.02)
        # The int4 kernel and the bfloat16 GEMM round differently.
        bf16 = packed_linear(x.bfloat16(), model[0].weight, model[0].bias)
        assert torch.equal(out, bf16.float()) == (rows > INT4_MAX_ROWS)


def test_int4_grid_refuses_weights_off_a_4_bit_grid():
    torch.manual_seed(0)
    grid = q4_grid_weight(16, 64)
    assert int4_grid(grid) is not None
    assert int4_grid(grid + 0.003 * torch.rand(16, 64)) is None
    assert int4_grid(torch.randn(16, 64)) is None and int4_grid(q4_grid_weight(8, 64)) is None


def test_torch_threads_shrink_to_the_usable_cpus_unless_omp_num_threads_is_set(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setattr(device, "usable_cpus", lambda: 1)
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
        cap_cpu_threads()
        assert torch.get_num_threads() == threads
        monkeypatch.delenv("OMP_NUM_THREADS")
        cap_cpu_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
