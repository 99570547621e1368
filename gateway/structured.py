"""A request's output constraint: response_format, vLLM's structured_outputs extra or its older
guided_* fields, as one StructuredOutputsParams, checked so that what is too large or cannot compile
is a 400."""
from pagedserve.common.grammar import GrammarError, check
from pagedserve.common.sampling_params import MAX_CONSTRAINT_CHARS, STRUCTURED_KINDS, StructuredOutputsParams
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.schemas import ChatCompletionRequest, ResponseFormat, SamplingFields

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def request_constraint(req: SamplingFields) -> tuple[str, StructuredOutputsParams] | None:
    """The constraint the client asked for and the field it came in, or None; a 400 naming the field
    for one that is malformed or comes with another. Not yet checked: see checked()."""
    given = [(param, params) for param, params in _given(req) if params is not None]
    if len(given) > 1:
        names = ", ".join(f"`{param}`" for param, _ in given)
        raise bad_request(f"Only one output constraint may be set, got {names}; keep one.",
                          param=given[1][0])
    return given[0] if given else None


def checked(params: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """`params`, once it is known to fit MAX_CONSTRAINT_CHARS and to compile; else a 400 naming
    `param`. Seconds of CPU for a large one: call it off the event loop."""
    size = _size(params)
    if size > MAX_CONSTRAINT_CHARS:
        raise bad_request(f"`{param}` makes a constraint of {size} characters; the limit is "
                          f"{MAX_CONSTRAINT_CHARS}.", param=param)
    try:
        check(params)
    except GrammarError as e:
        raise bad_request(f"`{param}` cannot be enforced: {e}. Fix it or remove `{param}`.",
                          param=param) from e
    return params


def _size(params: StructuredOutputsParams) -> int:
    if params.choice is not None:
        return sum(map(len, params.choice))
    return len(params.regex or params.grammar or params.schema_text() or "")


def _given(req: SamplingFields) -> list[tuple[str, StructuredOutputsParams | None]]:
    given = [(name, _field_kind(kind, getattr(req, name), name)) for name, kind in _GUIDED.items()]
    given.append(("structured_outputs", _structured_outputs(req)))
    if isinstance(req, ChatCompletionRequest):
        given.append(("response_format", _response_format(req.response_format)))
    return given


def _field_kind(kind: str, value: object, param: str) -> StructuredOutputsParams | None:
    if value is None:
        return None
    try:
        return StructuredOutputsParams(**{kind: value})
    except ValueError as e:
        raise bad_request(f"`{param}` is empty: {e}.", param=param) from e


def _structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    so = req.structured_outputs
    if so is None:
        return None
    values = {kind: getattr(so, kind) for kind in STRUCTURED_KINDS if getattr(so, kind) is not None}
    try:
        return StructuredOutputsParams(**values)
    except ValueError as e:
        raise bad_request(f"`structured_outputs` is invalid: {e}.", param="structured_outputs") from e


def _response_format(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise bad_request("`response_format` of type 'json_schema' needs `json_schema.schema`; add the "
                          "schema or use type 'json_object'.", param="response_format")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)
