"""A batch's lines: an input file checked as OpenAI checks it, and one line answered by the same
translation the endpoint's HTTP route runs, into the line of the output or error file."""
import time
from pathlib import Path

import msgspec

from pagedserve.gateway import pooling_routes, routes
from pagedserve.gateway.batch_store import new_id
from pagedserve.gateway.batch_schemas import BatchError, InputLine, LineError, LineResponse, OutputLine
from pagedserve.gateway.errors import APIError, ErrorBody, bad_request
from pagedserve.gateway.pooling_schemas import EmbeddingRequest, RerankRequest, ScoreRequest
from pagedserve.gateway.schemas import ChatCompletionRequest, CompletionRequest, decode_request
from pagedserve.gateway.serving import whole
from pagedserve.gateway.state import Gateway

# The most errors a failed validation reports; the file may have many more.
MAX_REPORTED_ERRORS = 100
_encoder = msgspec.json.Encoder()
_line_decoder = msgspec.json.Decoder(InputLine)
_REQUESTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
             "/v1/embeddings": EmbeddingRequest, "/v1/rerank": RerankRequest, "/v1/score": ScoreRequest}
# The endpoints a batch may run, as OpenAI and vLLM name them (the pooling ones need a pooling model).
ENDPOINTS = tuple(_REQUESTS)
_POOLING = {EmbeddingRequest: pooling_routes.embedding_response, RerankRequest: pooling_routes.rerank_response,
            ScoreRequest: pooling_routes.score_response}


def read_input(path: Path, endpoint: str) -> tuple[list[tuple[int, str, bytes]], list[BatchError]]:
    """The file's requests (line number, custom_id, body), and what is wrong with it: a line that is
    not a request, a url other than `endpoint`, a method other than POST, a custom_id seen before."""
    lines, errors, seen = [], [], set()
    with open(path, "rb") as given:
        for number, raw in enumerate(given, 1):
            if not raw.strip():
                continue
            line, error = _checked(raw, number, endpoint, seen)
            if error is not None:
                errors.append(error)
            else:
                lines.append(line)
            if len(errors) >= MAX_REPORTED_ERRORS:
                break
    if not lines and not errors:
        errors.append(BatchError(code="empty_file", message="The input file has no requests."))
    return lines, errors


def _checked(raw: bytes, number: int, endpoint: str,
             seen: set[str]) -> tuple[tuple[int, str, bytes] | None, BatchError | None]:
    try:
        line = _line_decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        return None, BatchError(code="invalid_json_line", line=number,
                                message=f"This line is not a batch request ({e}): write a JSON object with "
                                        "custom_id, method, url and body.")
    problem = _problem(line, endpoint, seen)
    if problem is not None:
        return None, BatchError(code=problem[0], message=problem[1], param=problem[2], line=number)
    seen.add(line.custom_id)
    return (number, line.custom_id, bytes(line.body)), None


def _problem(line: InputLine, endpoint: str, seen: set[str]) -> tuple[str, str, str] | None:
    if line.url != endpoint:
        return ("mismatched_endpoint", f"The url {line.url!r} differs from the batch's endpoint {endpoint!r}; "
                "every line must use the batch's endpoint.", "url")
    if line.method != "POST":
        return "invalid_method", f"The method {line.method!r} is not POST, the only one a batch runs.", "method"
    if line.custom_id in seen:
        return ("duplicate_custom_id", f"The custom_id {line.custom_id!r} is used twice; each line needs its "
                "own.", "custom_id")
    if not bytes(line.body).lstrip().startswith(b"{"):
        return "invalid_body", "The body is not a JSON object; send the request's JSON object.", "body"
    return None


async def respond(gateway: Gateway, endpoint: str, body: bytes) -> msgspec.Struct:
    """The body the endpoint's route answers `body` with, run as batch work; an APIError for what
    the route would refuse."""
    kind = _REQUESTS[endpoint]
    req = decode_request(body, kind)
    served = await gateway.served_for(req.model)
    if kind in _POOLING:
        return await _POOLING[kind](gateway, served, req, background=True)
    if req.stream:
        raise bad_request("`stream` is not supported in a batch; remove it from the line's body.", param="stream")
    start = time.monotonic()
    make = routes.chat_plan if kind is ChatCompletionRequest else routes.completion_plan
    plan, wire = await make(gateway, served, req, background=True)
    return await whole(plan, wire, start)


def answered(custom_id: str, request_id: str, body: msgspec.Struct) -> bytes:
    """A line's output line."""
    raw = msgspec.Raw(_encoder.encode(body))
    return _encoder.encode(OutputLine(request_id, custom_id, LineResponse(200, request_id, raw), None))


def refused(custom_id: str, request_id: str, error: APIError) -> bytes:
    """A line's error line, for a request the endpoint refused."""
    raw = msgspec.Raw(_encoder.encode(ErrorBody(error.info)))
    return _encoder.encode(OutputLine(request_id, custom_id, LineResponse(error.status, request_id, raw), None))


def expired(custom_id: str) -> bytes:
    """The error line of a line left unanswered when its batch expired."""
    error = LineError("batch_expired", "This request could not be executed before the completion window expired.")
    return _encoder.encode(OutputLine(new_id("batch_req_"), custom_id, None, error))
