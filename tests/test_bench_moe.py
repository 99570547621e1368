"""`python -m pagedserve.bench.moe --tiny`: the MoE sweep's whole path at a toy shape (on a CPU
under the Triton interpreter), the TUNED entries it prints are a table moe_config reads, and
they replace their shape's in kernels/moe_config.py."""
import json
from pathlib import Path

import torch

from pagedserve.bench.moe import (TINY, Shape, main, merged_entries, paste_tuned, small_batch_threshold,
                                  tuned_literal)
from pagedserve.kernels import moe_config as moe_config_module
from pagedserve.kernels.moe_config import (MoeConfig, MoeGemmConfig, MoeGemvConfig, SmallBatchMoeConfig,
                                           moe_config)

NAMES = {"MoeConfig": MoeConfig, "MoeGemmConfig": MoeGemmConfig, "MoeGemvConfig": MoeGemvConfig,
         "SmallBatchMoeConfig": SmallBatchMoeConfig}


def test_tiny_sweep_writes_a_table_moe_config_reads(tmp_path, capsys) -> None:
    # FP8 experts: the sweep tries both W8A8 and W8A16 at small M; the small-batch path is W8A16.
    assert main(["--tiny", "--kinds", "fp8", "--tokens", "3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "moe_sweep.json").read_text())
    assert [(c["path"], c["w8a8"], c["ok"]) for c in report["checks"]] == [
        ("grouped", True, True), ("grouped", False, True), ("small-batch", False, True)]
    (row,) = report["sweep"]["fp8"]
    assert {t["w8a8"] for t in row["block_m"]["16"]["gate_up"]} == {True, False}
    assert row["tokens"] == 3 and row["layer_ms"] > 0 and row["roofline_ms"] > 0
    (small,) = report["small_batch"]["fp8"]
    assert small["tokens"] == 3 and small["grouped"] == row["best"]
    assert all("ms" in t for t in small["tilings"]["gate_up"] + small["tilings"]["down"])
    literal = (tmp_path / "moe_tuned.txt").read_text()
    assert literal in capsys.readouterr().out
    table = eval("{" + literal + "}", NAMES)
    key = (TINY.experts, TINY.hidden, TINY.inter, TINY.top_k, "float8_e4m3fn")
    config = moe_config(3, *key[:4], torch.float8_e4m3fn, torch.bfloat16, table=table)
    faster = "small_batch" if small["small_batch_layer_ms"] < small["grouped_layer_ms"] else "grouped"
    assert config == table[key][3]
    assert isinstance(config, SmallBatchMoeConfig) == (faster == "small_batch")


def test_small_batch_sweep_alone(tmp_path, capsys) -> None:
    # The toy shape is not in TUNED: the path is checked and timed, and no entries are printed.
    assert main(["--tiny", "--small-batch", "--kinds", "bf16", "--tokens", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "moe_sweep.json").read_text())
    assert [(c["path"], c["tokens"], c["ok"]) for c in report["checks"]] == [("small-batch", 2, True)]
    assert report["sweep"]["bf16"] == [] and [r["tokens"] for r in report["small_batch"]["bf16"]] == [2]
    assert "not in TUNED" in capsys.readouterr().out
    assert (tmp_path / "moe_tuned.txt").read_text().strip() == ""


def gemv(n: int) -> SmallBatchMoeConfig:
    return SmallBatchMoeConfig(MoeGemvConfig(n, 512), MoeGemvConfig(n, 256))


def grouped(block_m: int) -> MoeConfig:
    return MoeConfig(block_m, MoeGemmConfig(32, 64), MoeGemmConfig(64, 64))


def swept(wins: dict[int, bool]) -> list[dict]:
    return [{"tokens": m, "small_batch_config": gemv(m), "grouped_config": grouped(m),
             "small_batch_layer_ms": 1.0 if won else 3.0, "grouped_layer_ms": 2.0} for m, won in wins.items()]


def test_small_batch_entries_up_to_the_first_m_it_loses() -> None:
    table = {1: grouped(16), 4: grouped(16), 64: grouped(64)}
    # Won at 1, 2 and 3, lost at 4: the grouped entry at 4 stays.
    rows = swept({1: True, 2: True, 3: True, 4: False, 8: True})
    assert small_batch_threshold(rows) == 3
    assert merged_entries(table, rows) == {1: gemv(1), 2: gemv(2), 3: gemv(3), 4: grouped(16),
                                           64: grouped(64)}
    # Won up to 4: the first M past it, 6, takes the grouped config timed there.
    rows = swept({1: True, 2: True, 4: True, 6: False, 8: False})
    entries = merged_entries(table, rows)
    assert entries == {1: gemv(1), 2: gemv(2), 4: gemv(4), 6: grouped(6), 64: grouped(64)}
    key = (TINY.experts, TINY.hidden, TINY.inter, TINY.top_k, "bfloat16")
    assert eval("{" + tuned_literal(TINY, "bf16", entries) + "}", NAMES) == {key: entries}
    # Lost at 1: the table as it was.
    assert merged_entries(table, swept({1: False, 2: True})) == table


def test_pasted_entries_replace_their_shape_in_moe_config() -> None:
    source = Path(moe_config_module.__file__).read_text()
    entries = {1: gemv(4), 16: grouped(16)}
    qwen, fp8 = (128, 2048, 768, 8, "bfloat16"), (128, 2048, 768, 8, "float8_e4m3fn")
    tiny = (TINY.experts, TINY.hidden, TINY.inter, TINY.top_k, "bfloat16")
    literal = tuned_literal(Shape(*qwen[:4]), "bf16", entries) + "\n" + tuned_literal(TINY, "bf16", entries)
    namespace: dict = {}
    exec(compile(paste_tuned(source, literal), "moe_config.py", "exec"), namespace)
    # The module's own classes: compared by repr.
    tuned = namespace["TUNED"]
    assert repr(tuned[qwen]) == repr(tuned[tiny]) == repr(entries)
    # The other shapes' entries, and the rest of the module, as they were.
    assert repr(tuned[fp8]) == repr(moe_config_module.TUNED[fp8])
    assert namespace["default_config"].__doc__ == moe_config_module.default_config.__doc__
