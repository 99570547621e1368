"""`python -m pagedserve.bench.moe --tiny`: the MoE sweep's whole path at a toy shape (on a CPU
under the Triton interpreter), and the TUNED entries it prints are a table moe_config reads."""
import json

import torch

from pagedserve.bench.moe import TINY, main
from pagedserve.kernels.moe_config import MoeConfig, MoeGemmConfig, moe_config


def test_tiny_sweep_writes_a_table_moe_config_reads(tmp_path, capsys) -> None:
    # FP8 experts: the sweep tries both W8A8 and W8A16 at small M.
    assert main(["--tiny", "--kinds", "fp8", "--tokens", "3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "moe_sweep.json").read_text())
    assert [(c["w8a8"], c["ok"]) for c in report["checks"]] == [(True, True), (False, True)]
    (row,) = report["sweep"]["fp8"]
    assert {t["w8a8"] for t in row["block_m"]["16"]["gate_up"]} == {True, False}
    assert row["tokens"] == 3 and row["layer_ms"] > 0 and row["roofline_ms"] > 0
    literal = (tmp_path / "moe_tuned.txt").read_text()
    assert literal in capsys.readouterr().out
    table = eval("{" + literal + "}", {"MoeConfig": MoeConfig, "MoeGemmConfig": MoeGemmConfig})
    key = (TINY.experts, TINY.hidden, TINY.inter, TINY.top_k, "float8_e4m3fn")
    config = moe_config(3, *key[:4], torch.float8_e4m3fn, torch.bfloat16, table=table)
    assert config == table[key][3] and config.block_m == row["best"]["block_m"]
