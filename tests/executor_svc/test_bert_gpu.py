"""The encoder forward on a GPU: its varlen FlashAttention path equals the padded SDPA path, and
the bge-m3 shape (XLM-R large, dummy bf16 weights) over batches of mixed 32–512-token inputs,
timed against the GEMM roofline (printed: run with -s). The timing also runs at a tiny shape on
the CPU, where its figure means nothing, so that the path is tested without a GPU.

    pytest -s tests/executor_svc/test_bert_gpu.py
"""
import time

import numpy as np
import pytest
import torch

from pagedserve.common.model_shapes import SHAPES
from pagedserve.executor_svc.device import default_dtype
from pagedserve.executor_svc.layers import encoder_attention
from pagedserve.executor_svc.layers.encoder_attention import attend, pack_sequences, use_varlen
from pagedserve.executor_svc.model_config import model_config_from_dict
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.weight_loader import load_weights

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
# H200 dense bf16 tensor-core peak.
PEAK_FLOPS = 989e12
TINY = dict(SHAPES["bge-m3"], vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4)
# Tokens per forward: what a step of the pooling runner may hold (its token budget).
GPU_BATCHES = (4096, 16384, 65536)


def dummy_encoder(shape: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    config = model_config_from_dict(shape)
    with torch.device(device), default_dtype(dtype):
        model = build_model(config, None, config.max_position_embeddings)
    load_weights(model, "", "dummy")
    return model.eval()


def mixed_lens(tokens: int, seed: int = 0) -> list[int]:
    """Input lengths ~U[32, 512] (seeded) adding up to about `tokens`."""
    rs = np.random.RandomState(seed)
    lens = []
    while sum(lens) < tokens:
        lens.append(int(rs.randint(32, 513)))
    return lens


def packed_inputs(lens: list[int], vocab: int, device: torch.device) -> dict:
    total = sum(lens)
    return dict(input_ids=torch.randint(5, vocab, (total,), device=device),
                positions=torch.cat([torch.arange(n, device=device) for n in lens]),
                token_type_ids=torch.zeros(total, dtype=torch.long, device=device), seq_lens=lens)


def gemm_flops_per_token(model: torch.nn.Module) -> float:
    """2 FLOPs per weight of every matrix the tokens go through (embeddings are lookups)."""
    return 2.0 * sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embeddings" not in name)


@torch.no_grad()
def seconds_per_forward(model: torch.nn.Module, inputs: dict, repeats: int) -> float:
    model(**inputs)
    sync = torch.cuda.synchronize if GPU else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        out = model(**inputs)
    sync()
    assert torch.isfinite(out).all()
    return (time.perf_counter() - start) / repeats


@needs_gpu
def test_varlen_attention_equals_padded_sdpa():
    """Torch's varlen FlashAttention is there (torch >= 2.9) and agrees with SDPA over padded
    sequences, in bf16 at bge-m3's heads."""
    device = torch.device("cuda")
    assert use_varlen(device, torch.bfloat16), "torch.nn.attention.varlen is missing: encoders pad for SDPA"
    lens = mixed_lens(8192)
    q, k, v = torch.randn(3, sum(lens), 16, 64, device=device, dtype=torch.bfloat16).unbind(0)
    varlen = attend(q, k, v, pack_sequences(lens, device, torch.bfloat16))
    padded = attend(q, k, v, pack_sequences(lens, device, torch.float32))
    torch.testing.assert_close(varlen, padded, atol=2e-2, rtol=2e-2)


@needs_gpu
def test_bge_m3_forward_is_the_same_through_either_attention(monkeypatch):
    device = torch.device("cuda")
    model = dummy_encoder(SHAPES["bge-m3"], device, torch.bfloat16)
    inputs = packed_inputs(mixed_lens(8192), 250002, device)
    with torch.no_grad():
        varlen = model(**inputs).float()
        monkeypatch.setattr(encoder_attention, "_varlen_attn", lambda: None)
        padded = model(**inputs).float()
    cosine = torch.nn.functional.cosine_similarity(varlen, padded, dim=-1)
    assert cosine.min() > 0.999, f"the two attention paths disagree: min cosine {cosine.min():.5f}"


@pytest.mark.parametrize("shape", [pytest.param("bge-m3", marks=needs_gpu), "tiny"])
def test_encoder_forward_throughput(shape):
    """Prints each batch's tokens/s, inputs/s and share of the GEMM roofline; checks only that
    the outputs are finite."""
    device = torch.device("cuda" if GPU and shape == "bge-m3" else "cpu")
    config = SHAPES["bge-m3"] if shape == "bge-m3" else TINY
    model = dummy_encoder(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    roofline = PEAK_FLOPS / gemm_flops_per_token(model)
    for tokens in GPU_BATCHES if device.type == "cuda" else (1024,):
        lens = mixed_lens(tokens)
        seconds = seconds_per_forward(model, packed_inputs(lens, config["vocab_size"], device),
                                      5 if device.type == "cuda" else 1)
        per_s = sum(lens) / seconds
        print(f"{shape} {device.type}: {len(lens)} inputs, {sum(lens)} tokens: {seconds * 1e3:.1f} ms, "
              f"{len(lens) / seconds:.0f} inputs/s, {per_s:.0f} tokens/s, {per_s / roofline:.1%} of the GEMM "
              f"roofline ({roofline:.0f} tokens/s at {PEAK_FLOPS / 1e12:.0f} TFLOP/s)")
