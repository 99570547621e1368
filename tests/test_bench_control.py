"""`pagedserve bench control-path`: a small run in both modes."""
import json

from tests.serving import run_cli


def test_control_path_in_process_and_over_grpc(tmp_path, capsys):
    out = tmp_path / "control.json"
    run_cli(["bench", "control-path", "--num-requests", "8", "--input-len", "16", "--output-len", "32",
              "--block-size", "4", "--output-json", str(out)])
    result = json.loads(out.read_text())
    for mode in ("in_process", "grpc"):
        m = result[mode]
        # One step prefills every prompt, 31 decode, one more sends the finished requests' drops.
        assert (m["steps"], m["full_batch_steps"]) == (33, 31)
        assert m["scheduler_stats"]["steps"] == 33 and m["steps_per_s"] > 0
        assert 0 < m["us_per_step"]["schedule"]["mean"] < m["us_per_step"]["step"]["mean"]
        # The null runner times the gap between its steps; every step but the first follows one.
        assert m["scheduler_stats"]["idle_steps"] == 32
    assert result["grpc"]["us_per_step"]["round_trip"]["mean"] > 0
    assert "gRPC round trip" in capsys.readouterr().out


def test_background_requests_alone_step_as_interactive_ones_do(tmp_path):
    out = tmp_path / "control.json"
    run_cli(["bench", "control-path", "--num-requests", "8", "--input-len", "16", "--output-len", "32",
             "--block-size", "4", "--mode", "in-process", "--background", "--output-json", str(out)])
    result = json.loads(out.read_text())
    assert result["background"] and (result["in_process"]["steps"], result["in_process"]["full_batch_steps"]) == (33, 31)
