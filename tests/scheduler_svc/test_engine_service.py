import pytest

from pagedserve.v1 import engine_pb2
from scheduler_svc.request import RequestOutput, TokenLogprobs
from scheduler_svc.server import response_from_outputs


def output(tokens: list[int], finished: bool = False, reason: str | None = None,
           logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
    return RequestOutput(seq_id=1, request_id="r", new_token_ids=tokens, finished=finished,
                         finish_reason=reason, stop_token_id=2 if reason == "stop" else None,
                         num_prompt_tokens=5, num_output_tokens=0, num_cached_tokens=4,
                         logprobs=logprobs)


def test_consecutive_outputs_travel_as_one_response():
    outs = [output([7]), output([8]), output([2], finished=True, reason="stop")]
    outs[-1].num_output_tokens = 3
    response = response_from_outputs(outs)
    assert list(response.token_ids) == [7, 8, 2]
    assert response.finish_reason == engine_pb2.FINISH_REASON_STOP
    assert response.stop_token_id == 2 and response.completion_tokens == 3
    assert (response.prompt_tokens, response.cached_tokens) == (5, 4)


@pytest.mark.parametrize("count", [1, 3])
def test_merged_logprobs_stay_one_per_token(count):
    outs = [output([10 + i], logprobs=[TokenLogprobs(-0.5 * i, i + 1, [10 + i], [-0.5 * i])])
            for i in range(count)]
    response = response_from_outputs(outs)
    assert [lp.rank for lp in response.logprobs] == list(range(1, count + 1))
    assert [list(lp.top_token_ids) for lp in response.logprobs] == [[10 + i] for i in range(count)]
    assert not response.HasField("stop_token_id")
    assert response.finish_reason == engine_pb2.FINISH_REASON_UNSPECIFIED
