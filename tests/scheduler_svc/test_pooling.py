import pytest

from pagedserve.common.config import EngineConfig
from pagedserve.common.plan import ExecutorInfo, PoolingInfo, StepResult
from pagedserve.common.pooling_params import PoolingParams
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.scheduler_svc.request import Request
from pagedserve.scheduler_svc.scheduler import Scheduler


def pooling_scheduler(num_blocks: int = 16, block_size: int = 4, max_num_batched_tokens: int = 16,
                      max_num_seqs: int = 8, runner: str = "pooling", **config) -> Scheduler:
    info = ExecutorInfo(num_blocks=num_blocks, block_size=block_size, dtype="none", device="none",
                        vocab_size=1000, max_model_len=16, eos_token_ids=[0], max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, runner=runner,
                        pooling=PoolingInfo(["embed"], 8, [4, 2], True))
    return Scheduler(EngineConfig(**config), info)


def add_pooling(s: Scheduler, seq_id: int, n: int, **kwargs) -> Request:
    request = Request(seq_id, f"p{seq_id}", list(range(1, n + 1)), SamplingParams(),
                      pooling=PoolingParams(), **kwargs)
    s.add(request)
    return request


def pooled_result(plan, size: int = 2) -> StepResult:
    """What the executor returns: `size` values per pooling request it computed whole."""
    seq_ids = [r.seq_id for r in plan.new_requests]
    return StepResult(plan.step_id, pooled_seq_ids=seq_ids, pooled_sizes=[size] * len(seq_ids),
                      pooled_data=[float(i) for s in seq_ids for i in (s,) * size])


def test_a_pooling_prompt_is_scheduled_whole_then_ends_with_its_data_and_frees_its_blocks():
    s = pooling_scheduler(max_num_batched_tokens=16)
    for seq_id, n in ((1, 10), (2, 5), (3, 3)):
        add_pooling(s, seq_id, n)
    plan = s.schedule()
    # 10 + 5 fit the budget of 16; the third (3) would too, but is never split: it waits.
    assert [(r.seq_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in plan.new_requests] == [
        (1, 0, 10), (2, 0, 5)]
    assert all(r.pooling == PoolingParams() for r in plan.new_requests)
    # Planned ahead of the result: the pooling requests in flight are not planned again.
    ahead = s.schedule()
    assert [r.seq_id for r in ahead.new_requests] == [3] and not ahead.continuing
    outs = s.update(plan, pooled_result(plan))
    assert [(o.seq_id, o.finished, o.finish_reason, o.pooled, o.num_prompt_tokens) for o in outs] == [
        (1, True, "stop", [1.0, 1.0], 10), (2, True, "stop", [2.0, 2.0], 5)]
    s.update(ahead, pooled_result(ahead))
    assert s.num_free_blocks == s.block_manager.num_usable_blocks
    assert not s.has_work() or s.schedule().new_requests == []
    assert s.num_prompt_tokens == 18


def test_a_pooling_prompt_runs_whole_past_the_long_prefill_threshold():
    s = pooling_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=4)
    add_pooling(s, 1, 10)
    plan = s.schedule()
    assert [(r.seq_id, r.num_scheduled_tokens) for r in plan.new_requests] == [(1, 10)]


def test_pooling_requests_skip_the_prefix_cache():
    s = pooling_scheduler()
    add_pooling(s, 1, 9)
    plan = s.schedule()
    s.update(plan, pooled_result(plan))
    add_pooling(s, 2, 9)
    plan = s.schedule()
    assert plan.new_requests[0].num_computed_tokens == 0 and plan.new_requests[0].num_scheduled_tokens == 9
    assert s.prefix_cache_hits == 0


def test_a_prompt_past_the_step_budget_or_of_the_wrong_kind_is_refused():
    s = pooling_scheduler(max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="more than one step computes .8.; shorten it"):
        add_pooling(s, 1, 9)
    with pytest.raises(ValueError, match="maximum context length is 16"):
        add_pooling(s, 1, 17)
    with pytest.raises(ValueError, match="token_type_ids has 2 entries for 3 tokens"):
        add_pooling(s, 1, 3, token_type_ids=[0, 1])
    with pytest.raises(ValueError, match="--runner pooling: it embeds"):
        s.add(Request(1, "g1", [1, 2], SamplingParams()))
    with pytest.raises(ValueError, match="start the engine with --runner pooling"):
        add_pooling(pooling_scheduler(runner="generate"), 1, 3)



def test_tasks_and_dimensions_the_model_does_not_serve_are_refused():
    s = pooling_scheduler()
    with pytest.raises(ValueError, match="does not support the 'classify' task; it serves embed"):
        s.add(Request(1, "p1", [1, 2], SamplingParams(), pooling=PoolingParams("classify")))
    with pytest.raises(ValueError, match=r"only supports \[4, 2\] for matryoshka representation, got dimensions=3"):
        s.add(Request(1, "p1", [1, 2], SamplingParams(), pooling=PoolingParams(dimensions=3)))
    s.pooling = PoolingInfo(["embed"], 8)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        s.add(Request(1, "p1", [1, 2], SamplingParams(), pooling=PoolingParams(dimensions=4)))
    s.pooling = PoolingInfo(["embed"], 8, is_matryoshka=True)
    with pytest.raises(ValueError, match="exceeds the model's embedding size 8"):
        s.add(Request(1, "p1", [1, 2], SamplingParams(), pooling=PoolingParams(dimensions=9)))
    s.add(Request(1, "p1", [1, 2], SamplingParams(), pooling=PoolingParams(dimensions=5)))
