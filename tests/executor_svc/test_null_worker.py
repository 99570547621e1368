"""The null worker: plan deltas tracked as the real runner does, TOKEN sampled at the end of
each request's known tokens."""
from pagedserve.common.plan import ContinuingRequest, NewRequest, StepPlan
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.executor_svc.null_worker import TOKEN, NullWorker, null_executor_info


def test_null_worker_samples_once_all_known_tokens_are_computed():
    worker = NullWorker(null_executor_info(num_blocks=16, block_size=4, max_model_len=64))
    chunk = StepPlan(1, new_requests=[NewRequest(1, [5] * 6, 0, 4, [1, 2], SamplingParams()),
                                      NewRequest(2, [5] * 3, 0, 3, [3], SamplingParams())])
    result = worker.run(chunk)
    assert (result.seq_ids, result.token_ids) == ([2], [TOKEN])
    result = worker.run(StepPlan(2, continuing=[ContinuingRequest(1, 2, []), ContinuingRequest(2, 1, [4])]))
    assert result.seq_ids == [1, 2] and result.step_id == 2
    assert worker.requests[2].num_blocks == 2 and worker.requests[1].num_tokens == 7
    worker.run(StepPlan(3, dropped=[1]))
    assert list(worker.requests) == [2]
    worker.reset()
    assert not worker.requests
