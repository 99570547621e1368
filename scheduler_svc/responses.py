"""The Engine service's replies: engine outputs as GenerateResponses, refusals as status codes."""
import grpc

from pagedserve.v1 import engine_pb2
from pagedserve.scheduler_svc.engine_loop import ExecutorLost
from pagedserve.scheduler_svc.request import RequestDelta
from pagedserve.scheduler_svc.scheduler import QueueFull

FINISH_REASONS = {None: engine_pb2.FINISH_REASON_UNSPECIFIED, "stop": engine_pb2.FINISH_REASON_STOP,
                  "length": engine_pb2.FINISH_REASON_LENGTH, "abort": engine_pb2.FINISH_REASON_ABORT}
REFUSALS = ((QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED), (ExecutorLost, grpc.StatusCode.UNAVAILABLE),
            (ValueError, grpc.StatusCode.INVALID_ARGUMENT))


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The StatusCode of its number (a RequestError's code)."""
    return _CODES.get(value, grpc.StatusCode.INTERNAL)


def refusal_code(error: Exception) -> grpc.StatusCode:
    """The status a request refused by EngineLoop.add ends with."""
    return next(code for kind, code in REFUSALS if isinstance(error, kind))


def response_from_outputs(outs: list[RequestDelta]) -> engine_pb2.GenerateResponse:
    """One response for consecutive outputs of one request: their tokens, the last one's state."""
    last = outs[-1]
    response = engine_pb2.GenerateResponse(
        token_ids=[t for out in outs for t in out.new_token_ids],
        finish_reason=FINISH_REASONS[last.finish_reason], prompt_tokens=last.num_prompt_tokens,
        completion_tokens=last.num_output_tokens, cached_tokens=last.num_cached_tokens,
        stop_token_id=last.stop_token_id)
    for out in outs:
        for t in out.logprobs or ():
            response.logprobs.add(logprob=t.logprob, rank=t.rank, top_token_ids=t.top_token_ids,
                                  top_logprobs=t.top_logprobs)
        for t in out.prompt_logprobs or ():
            response.prompt_logprobs.add(logprob=t.logprob, rank=t.rank, top_token_ids=t.top_token_ids,
                                         top_logprobs=t.top_logprobs)
    return response
