from pagedserve.common.plan import (ContinuingRequest, ExecutorInfo, NewRequest, PoolingInfo, StepLogprobs,
                                    StepPlan, StepResult, info_from_proto, info_to_proto, plan_from_proto,
                                    plan_to_proto, result_from_proto, result_to_proto)
from pagedserve.common.pooling_params import PoolingParams
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.v1 import executor_pb2 as pb


def test_plan_survives_the_wire():
    params = SamplingParams(temperature=0.5, top_p=0.75, top_k=4, min_p=0.125, seed=11)
    plan = StepPlan(7,
                    new_requests=[NewRequest(3, [5, 6, 7], 0, 3, [4], params),
                                  NewRequest(4, [8], 0, 1, [9], SamplingParams())],
                    continuing=[ContinuingRequest(1, 1, []), ContinuingRequest(2, 16, [10, 11])],
                    dropped=[5, 6])
    wire = pb.StepPlan.FromString(plan_to_proto(plan).SerializeToString())
    back = plan_from_proto(wire)
    assert back == StepPlan(7, [NewRequest(3, [5, 6, 7], 0, 3, [4], params),
                                NewRequest(4, [8], 0, 1, [9], SamplingParams())],
                            [ContinuingRequest(1, 1, []), ContinuingRequest(2, 16, [10, 11])], [5, 6])
    assert all(type(r.new_block_ids) is list for r in back.continuing)


def test_new_sampling_params_mask_ids_and_prompt_length_survive_the_wire():
    params = SamplingParams(temperature=0.5, max_tokens=None, min_tokens=3, stop_token_ids=[9],
                            presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.25, logprobs=0)
    plan = StepPlan(1, new_requests=[NewRequest(3, [5, 6, 7, 8], 0, 4, [4], params, num_prompt_tokens=2,
                                                min_tokens_mask_ids=[2, 9]),
                                     NewRequest(4, [8], 0, 1, [9], SamplingParams())])
    back = plan_from_proto(pb.StepPlan.FromString(plan_to_proto(plan).SerializeToString()))
    assert back == plan
    assert back.new_requests[1].sampling.logprobs is None and back.new_requests[1].num_prompt_tokens is None
    assert back.new_requests[1].min_tokens_mask_ids == []


def test_result_survives_the_wire():
    result = StepResult(7, [1, 2], [30, 40], forward_ns=1500, idle_ns=250)
    wire = pb.StepResult.FromString(result_to_proto(result).SerializeToString())
    assert result_from_proto(wire) == result
    result.logprobs = StepLogprobs([1], [-0.5], [2], [2], [40, 30], [-0.25, -0.5])
    wire = pb.StepResult.FromString(result_to_proto(result).SerializeToString())
    assert result_from_proto(wire) == result


def test_pooling_requests_and_pooled_data_survive_the_wire():
    plan = StepPlan(2, new_requests=[NewRequest(3, [5, 6], 0, 2, [4], SamplingParams(),
                                                pooling=PoolingParams("embed", False, 8), token_type_ids=[0, 1]),
                                     NewRequest(4, [8], 0, 1, [9], SamplingParams(),
                                                pooling=PoolingParams("classify", activation=False))])
    assert plan_from_proto(pb.StepPlan.FromString(plan_to_proto(plan).SerializeToString())) == plan
    result = StepResult(2, pooled_seq_ids=[3, 4], pooled_sizes=[2, 1], pooled_data=[0.5, -0.25, 2.0])
    back = result_from_proto(pb.StepResult.FromString(result_to_proto(result).SerializeToString()))
    assert back == result and back.pooled() == {3: [0.5, -0.25], 4: [2.0]}
    info = ExecutorInfo(8, 16, "float32", "cpu", 100, 64, [2], 4, 64, runner="pooling",
                        pooling=PoolingInfo(["embed"], 32, [16, 8], True, 0, "query: "))
    assert info_from_proto(info_to_proto(info)) == info


def test_the_largest_mixed_graph_and_the_kv_cache_dtype_survive_the_wire():
    info = ExecutorInfo(8, 16, "bfloat16", "cuda", 100, 64, [2], 4, 64, mixed_graph_tokens=512,
                        kv_cache_dtype="float8_e4m3fn")
    assert info_from_proto(info_to_proto(info)) == info
