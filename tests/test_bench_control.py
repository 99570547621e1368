"""`pagedserve bench control-path`: the null model runner, and a small run in both modes."""
import json

from pagedserve.bench.control import TOKEN, NullModelRunner, null_executor_info
from pagedserve.common.plan import ContinuingRequest, NewRequest, StepPlan
from pagedserve.common.sampling_params import SamplingParams
from tests.serving import run_cli


def test_null_runner_samples_once_all_known_tokens_are_computed():
    runner = NullModelRunner(null_executor_info(num_blocks=16, block_size=4, max_model_len=64))
    chunk = StepPlan(1, new_requests=[NewRequest(1, [5] * 6, 0, 4, [1, 2], SamplingParams()),
                                      NewRequest(2, [5] * 3, 0, 3, [3], SamplingParams())])
    result = runner.run(chunk)
    assert (result.seq_ids, result.token_ids) == ([2], [TOKEN])
    result = runner.run(StepPlan(2, continuing=[ContinuingRequest(1, 2, []), ContinuingRequest(2, 1, [4])]))
    assert result.seq_ids == [1, 2] and result.step_id == 2
    assert runner.requests[2].num_blocks == 2 and runner.requests[1].num_tokens == 7
    runner.run(StepPlan(3, dropped=[1]))
    assert list(runner.requests) == [2]
    runner.reset()
    assert not runner.requests


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
