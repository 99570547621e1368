"""The rows o_proj and down_proj run small steps on, and the decode graph sizes worth capturing
(executor_svc/projection_rows.py): which projections take them, the rules that pick, and the
timing on a GPU."""
import pytest
import torch

from pagedserve.executor_svc import projection_rows
from pagedserve.executor_svc.attention_backend import get_backend
from pagedserve.executor_svc.cuda_graphs import capture_sizes
from pagedserve.executor_svc.device import default_dtype
from pagedserve.executor_svc.fp8 import quantize_linears
from pagedserve.executor_svc.layers.decoder import fold_norms
from pagedserve.executor_svc.layers.linear import PROJECTION_ROWS, Linear, input_rows
from pagedserve.executor_svc.model_config import load_model_config
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.projection_rows import (CANDIDATES, LEAST_PRUNED, choose, decode_sizes, outrun, pick,
                                                     row_projections)
from pagedserve.kernels.quant import per_token_quant_fp8
from tests.tiny_models import make_tiny_model

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="times GEMMs on a GPU")


def tiny(arch: str, tmp_path, device: str = "cpu", **config_overrides) -> torch.nn.Module:
    config = load_model_config(make_tiny_model(arch, tmp_path, **config_overrides))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device), default_dtype(dtype):
        return build_model(config, get_backend(torch.device(device)), 64)


def test_pick_keeps_32_rows_unless_64_are_faster_by_the_margin():
    assert pick({32: 1.0, 64: 1.2}) == 32
    assert pick({32: 1.0, 64: 0.995}) == PROJECTION_ROWS
    assert pick({32: 1.0, 64: 0.97}) == 64


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3MoeForCausalLM"])
def test_row_projections_are_each_layers_o_proj_and_dense_down_proj(tmp_path, arch: str):
    model = tiny(arch, tmp_path)
    expected = [layer.self_attn.o_proj for layer in model.model.layers]
    expected += [layer.mlp.down_proj for layer in model.model.layers if hasattr(layer.mlp, "down_proj")]
    assert sorted(map(id, row_projections(model))) == sorted(map(id, expected))
    assert (len(row_projections(model)) == 2 * len(model.model.layers)) == (arch == "LlamaForCausalLM")


def test_choose_gives_every_row_projection_the_faster_candidate(tmp_path, monkeypatch):
    model = tiny("LlamaForCausalLM", tmp_path)
    monkeypatch.setattr(projection_rows, "time_rows", lambda projections, adds: {32: 1.0, 64: 0.9})
    choose(model, None)
    assert {p.min_rows for p in row_projections(model)} == {64}
    assert Linear.min_rows == PROJECTION_ROWS


@GPU
@pytest.mark.parametrize("fold", [False, True], ids=["linear", "folded"])
def test_choose_times_both_candidates_on_a_gpu(tmp_path, fold: bool):
    model = tiny("LlamaForCausalLM", tmp_path, "cuda")
    if fold:
        assert fold_norms(model)
    ms = projection_rows.time_rows(row_projections(model), fold)
    assert set(ms) == set(CANDIDATES) and all(t > 0 for t in ms.values())
    choose(model, None)
    (rows,) = {p.min_rows for p in row_projections(model)}
    assert rows in CANDIDATES
    o_proj = model.model.layers[0].self_attn.o_proj
    assert [input_rows(o_proj, n) for n in (1, 32, 33)] == [rows, rows, 33]


def test_outrun_lists_the_row_counts_a_larger_one_beats_by_the_margin():
    assert outrun({400: 1.0, 416: 0.96, 448: 1.2, 512: 0.95}) == [400, 448]
    assert outrun({400: 1.0, 512: 0.99}) == []
    assert outrun({400: 0.9, 512: 1.0}) == []


def test_decode_sizes_leave_out_only_timed_sizes_a_larger_one_beats(tmp_path, monkeypatch):
    model = tiny("LlamaForCausalLM", tmp_path)
    sizes = capture_sizes(512)
    timed = []

    def fake(projections, adds, candidates):
        timed.extend(candidates)
        assert len(projections) == 4 and not adds
        return {rows: 0.5 if rows == 512 else 1.0 for rows in candidates}
    monkeypatch.setattr(projection_rows, "time_rows", fake)
    kept = decode_sizes(model, sizes)
    assert timed == [s for s in sizes if s >= LEAST_PRUNED]
    assert kept == [s for s in sizes if s < LEAST_PRUNED] + [512]


@pytest.mark.parametrize("dense_first", [False, True], ids=["all-sparse", "dense-layer-0"])
def test_decode_sizes_keep_every_size_of_a_mixture_of_experts(tmp_path, monkeypatch, dense_first: bool):
    model = tiny("Qwen3MoeForCausalLM", tmp_path, mlp_only_layers=[0] if dense_first else [])
    assert (type(model.model.layers[0].mlp).__name__ == "GatedMLP") == dense_first
    monkeypatch.setattr(projection_rows, "time_rows", lambda *args: pytest.fail("timed"))
    assert decode_sizes(model, capture_sizes(512)) == capture_sizes(512)


@GPU
@pytest.mark.parametrize("dtype", ["bf16", "folded", "fp8"])
def test_decode_sizes_time_a_layers_projections_on_a_gpu(tmp_path, dtype: str):
    model = tiny("LlamaForCausalLM", tmp_path, "cuda")
    if dtype == "folded":
        assert fold_norms(model)
    if dtype == "fp8":
        quantize_linears(model, per_token_quant_fp8)
    layer = model.model.layers[0]
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    ms = projection_rows.time_rows(projections, layer.folded, [136, 512])
    assert set(ms) == {136, 512} and all(t > 0 for t in ms.values())
    sizes = capture_sizes(512)
    kept = decode_sizes(model, sizes)
    assert [s for s in kept if s < LEAST_PRUNED] == [s for s in sizes if s < LEAST_PRUNED]
    assert kept[-1] == 512 and set(kept) <= set(sizes)
