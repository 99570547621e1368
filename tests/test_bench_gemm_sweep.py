"""The GEMM sweep's projections (its timing needs a GPU): each dense shape's four projections with
the widths its decoder layers hold, o_proj and down_proj the ones added into the stream."""
import subprocess
import sys

import pytest

from pagedserve.bench.gemm_sweep import DENSE, layer_us, projections
from pagedserve.common.model_shapes import SHAPES
from pagedserve.executor_svc.model_config import model_config_from_dict


@pytest.mark.parametrize("name, widths", [
    ("llama-3.1-8b", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]),
    ("qwen2.5-7b", [(3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584)]),
    ("phi-4-mini", [(3072, 5120), (3072, 3072), (3072, 16384), (8192, 3072)]),
])
def test_projections_have_the_shapes_widths(name, widths):
    got = projections(model_config_from_dict(SHAPES[name]))
    assert [p.name for p in got] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert [(p.in_features, p.out_features) for p in got] == widths
    assert [p.adds for p in got] == [False, True, False, True]


def test_dense_leaves_out_experts_and_encoders():
    assert "llama-3.1-8b" in DENSE and "gemma-2-9b" in DENSE
    assert not {"qwen3-30b-a3b", "bge-m3", "bge-reranker-v2-m3"} & set(DENSE)


def test_an_unknown_shape_is_refused_with_the_choices():
    run = subprocess.run([sys.executable, "-m", "pagedserve.bench.gemm_sweep", "bge-m3"],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "not a dense decoder: bge-m3" in run.stderr and "qwen2.5-7b" in run.stderr


def test_layer_us_sums_a_layers_projections_by_rows_and_library():
    def result(us: float) -> dict:
        return {"us": us, "kernels": [], "split_k": False}
    sweep = {"qkv_proj": {16: {"cublas": result(22.0), "cublaslt": result(22.5)},
                          128: {"cublas": result(22.0), "cublaslt": result(22.0)}},
             "down_proj": {16: {"cublas": result(46.75), "cublaslt": result(46.5)},
                           128: {"cublas": result(52.25), "cublaslt": result(45.0)}}}
    assert layer_us(sweep) == {16: {"cublas": 68.75, "cublaslt": 69.0},
                               128: {"cublas": 74.25, "cublaslt": 67.0}}
