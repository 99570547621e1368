"""The rows o_proj and down_proj run small steps on (executor_svc/projection_rows.py): which
projections take them, the rule that picks a candidate, and the timing on a GPU."""
import pytest
import torch

from pagedserve.executor_svc import projection_rows
from pagedserve.executor_svc.attention_backend import get_backend
from pagedserve.executor_svc.device import default_dtype
from pagedserve.executor_svc.layers.decoder import fold_norms
from pagedserve.executor_svc.layers.linear import PROJECTION_ROWS, Linear, input_rows
from pagedserve.executor_svc.model_config import load_model_config
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.projection_rows import CANDIDATES, choose, pick, row_projections
from tests.tiny_models import make_tiny_model

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="times GEMMs on a GPU")


def tiny(arch: str, tmp_path, device: str = "cpu") -> torch.nn.Module:
    config = load_model_config(make_tiny_model(arch, tmp_path))
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
