"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items and POST /v1/responses/{id}/cancel (for background ones). A
translator: the request's items become a chat (OpenAI's chat form) in a NeutralRequest, and its
output events become output items (responses_output)."""
import functools
import time

import msgspec
from aiohttp import web
from msgspec import UNSET

from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.gateway import responses_background
from pagedserve.gateway.admission import engine_route, served_for
from pagedserve.gateway.errors import APIError, bad_request
from pagedserve.gateway.request_plan import NeutralRequest, plan
from pagedserve.gateway.response_store import ResponseStore, StoredResponse
from pagedserve.gateway.responses_output import ResponsesOutput, new_id
from pagedserve.gateway.responses_schemas import (INCLUDE_LOGPROBS, DeletedResponse, FunctionTool, InputItem,
                                                  InputItemList, Response, ResponsesRequest, TextOptions)
from pagedserve.gateway.schemas import (ChatMessage, FunctionCallIn, FunctionDefinition, NamedFunction,
                                        NamedToolChoice, SamplingFields, Tool, ToolCallIn)
from pagedserve.gateway.serving import json_response, read_json, run
from pagedserve.gateway.sse import SSEWriter
from pagedserve.gateway.state import GATEWAY

_TEXT_PARTS = ("input_text", "output_text", "text")
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_encoder = msgspec.json.Encoder()
# What the request plan's errors name, as this API names it.
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input", "logprobs": "top_logprobs"}


@engine_route
async def create_response(request: web.Request) -> web.StreamResponse:
    req = await read_json(request, ResponsesRequest)
    gateway = request.app[GATEWAY]
    _check_supported(req)
    history = _history(gateway.responses, req.previous_response_id)
    turn = chat_messages(req.input)
    instructions = [ChatMessage("system", req.instructions)] if req.instructions else []
    p = await plan(gateway, await served_for(request, req.model), neutral_request(req, instructions + history + turn))
    output = ResponsesOutput(_in_progress(req, p.model),
                             functools.partial(_store, gateway.responses, req, turn) if req.store else _keep_nothing,
                             logprobs=_wants_logprobs(req))
    if req.background:
        return json_response(responses_background.start(gateway, p, output))
    return await run(request, p, output, functools.partial(SSEWriter.open, named=True))


async def cancel_response(request: web.Request) -> web.Response:
    store = request.app[GATEWAY].responses
    response_id = request.match_info["response_id"]
    if not await responses_background.cancel(store, response_id):
        entry = _stored(request)
        raise bad_request(f"Only a background response in progress can be cancelled; this one is "
                          f"{entry.response.status}.", param="response_id")
    return json_response(_stored(request).response)


async def get_response(request: web.Request) -> web.Response:
    return json_response(_stored(request).response)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    store = request.app[GATEWAY].responses
    # A background response still running would store itself again when it ends.
    await responses_background.cancel(store, response_id)
    if not store.delete(response_id):
        raise _not_found(response_id)
    return json_response(DeletedResponse(response_id))


async def list_input_items(request: web.Request) -> web.Response:
    """The stored response's input items, newest first unless order=asc; `limit` (1-100, 20) and
    `after` (an item id) page through them."""
    items = _stored(request).input_items
    query = request.query
    if query.get("order", "desc") not in ("asc", "desc"):
        raise bad_request("`order` must be 'asc' or 'desc'.", param="order")
    ordered = items if query.get("order") == "asc" else items[::-1]
    if "after" in query:
        ids = [item["id"] for item in ordered]
        if query["after"] not in ids:
            raise bad_request(f"No input item has the id '{query['after'][:64]}'.", param="after")
        ordered = ordered[ids.index(query["after"]) + 1:]
    limit = _limit(query.get("limit", "20"))
    page = ordered[:limit]
    return json_response(InputItemList(page, page[0]["id"] if page else None, page[-1]["id"] if page else None,
                                       len(ordered) > limit))


def _limit(raw: str) -> int:
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise bad_request("`limit` must be a whole number from 1 to 100.", param="limit")
    return int(raw)


def _stored(request: web.Request) -> StoredResponse:
    response_id = request.match_info["response_id"]
    entry = request.app[GATEWAY].responses.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response with id '{response_id[:64]}' is stored here (it was not stored, was "
                    "deleted, or aged out of the store: see --responses-store-mb and --responses-store-ttl).",
                    param="response_id", code="not_found")


def _check_supported(req: ResponsesRequest) -> None:
    if req.background and (req.stream or req.store is False):
        raise bad_request("`background` needs `store` (the response is fetched later) and no `stream`; send "
                          "`background: true` alone, or `stream: true` alone.", param="background")
    if isinstance(req.input, list) and not req.input:
        raise bad_request("`input` is empty; send a string or at least one input item.", param="input")


def _history(store: ResponseStore, previous_id: str | None) -> list[ChatMessage]:
    """The conversation up to and including `previous_id`'s output, oldest turn first."""
    turns = []
    while previous_id is not None:
        entry = store.get(previous_id)
        if entry is None:
            raise bad_request(f"Previous response with id '{previous_id[:64]}' not found: it was not stored "
                              "(`store: false`), was deleted, or aged out of this server's store.",
                              param="previous_response_id")
        if entry.response.status not in ("completed", "incomplete"):
            raise bad_request(f"Previous response '{previous_id[:64]}' is {entry.response.status}: only a finished "
                              "response can be continued.", param="previous_response_id")
        turns.append(entry.turn)
        previous_id = entry.response.previous_response_id
    return [message for turn in reversed(turns) for message in turn]


def chat_messages(given: str | list[InputItem]) -> list[ChatMessage]:
    """The input items as chat messages: a function_call joins the assistant message before it (or
    starts one), its output becomes a tool message, and reasoning goes with the next assistant message."""
    if isinstance(given, str):
        return [ChatMessage("user", given)]
    messages: list[ChatMessage] = []
    reasoning = None
    for i, item in enumerate(given):
        if item.type == "reasoning":
            reasoning = _item_text(item.content or item.summary or [], i)
            continue
        message = _message(item, i, messages)
        if message.role == "assistant" and reasoning is not None:
            message.reasoning, reasoning = reasoning, None
        if not messages or messages[-1] is not message:
            messages.append(message)
    return messages


def _message(item: InputItem, index: int, messages: list[ChatMessage]) -> ChatMessage:
    """The chat message `item` makes, or extends (the last one, for a function_call)."""
    if item.type == "message":
        if item.role is None:
            raise bad_request(f"`input[{index}]` is a message without a `role`; add one.", param=f"input[{index}].role")
        return ChatMessage(item.role, _item_text(item.content, index))
    if item.type == "function_call":
        if item.call_id is None or item.name is None:
            raise bad_request(f"`input[{index}]` is a function_call without `call_id` or `name`; add both.",
                              param=f"input[{index}]")
        call = ToolCallIn(FunctionCallIn(item.name, item.arguments or "{}"), id=item.call_id)
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            last.tool_calls = [*(last.tool_calls or []), call]
            return last
        return ChatMessage("assistant", None, tool_calls=[call])
    if item.type == "function_call_output":
        if item.call_id is None or item.output is None:
            raise bad_request(f"`input[{index}]` is a function_call_output without `call_id` or `output`; add both.",
                              param=f"input[{index}]")
        return ChatMessage("tool", _item_text(item.output, index), tool_call_id=item.call_id)
    raise bad_request(f"Input items of type '{item.type[:64]}' are not supported; send message, function_call, "
                      "function_call_output or reasoning items.", param=f"input[{index}].type")


def _item_text(content: str | list | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type not in (*_TEXT_PARTS, "reasoning_text", "summary_text") or part.text is None:
            raise bad_request(f"Content parts of type '{part.type[:64]}' are not supported (this server reads "
                              "text only); send input_text parts.", param=f"input[{index}].content")
    return "".join(part.text for part in content)


def neutral_request(req: ResponsesRequest, messages: list[ChatMessage]) -> NeutralRequest:
    sampling = SamplingFields(model=req.model, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed, stream=req.stream)
    effort = req.reasoning.effort if req.reasoning is not None else None
    return NeutralRequest(sampling, messages=messages, tools=_tools(req.tools), tool_choice=_tool_choice(req),
                          parallel_tool_calls=req.parallel_tool_calls, constraint=_constraint(req.text),
                          max_tokens=req.max_output_tokens, drop_oldest_turns=req.truncation == "auto",
                          logprobs=(req.top_logprobs or 0) if _wants_logprobs(req) else None,
                          chat_template_kwargs=None if effort is None else {"reasoning_effort": effort},
                          field_names=_FIELD_NAMES)


def _wants_logprobs(req: ResponsesRequest) -> bool:
    """OpenAI's rule: output_text carries logprobs where `include` asks for them; `top_logprobs`
    says how many of the likeliest tokens each one lists."""
    return INCLUDE_LOGPROBS in (req.include or ())


def _tools(tools: list[FunctionTool] | None) -> list[Tool] | None:
    if not tools:
        return None
    others = sorted({t.type for t in tools} - {"function"})
    if others:
        raise bad_request(f"Tools of type {', '.join(repr(t[:32]) for t in others)} are not supported; this server "
                          "runs function tools only. Remove the others.", param="tools")
    nameless = next((i for i, t in enumerate(tools) if not t.name), None)
    if nameless is not None:
        raise bad_request(f"`tools[{nameless}]` has no `name`; name every function.", param=f"tools[{nameless}].name")
    return [Tool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.parameters,
                                             strict=t.strict)) for t in tools]


def _tool_choice(req: ResponsesRequest) -> str | NamedToolChoice | None:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise bad_request(f"`tool_choice` of type '{choice.type[:32]}' is not supported; send \"none\", \"auto\", "
                          "\"required\" or {\"type\": \"function\", \"name\": ...}.", param="tool_choice")
    return NamedToolChoice(function=NamedFunction(choice.name))


def _constraint(text: TextOptions | None) -> tuple[str, StructuredOutputsParams] | None:
    fmt = None if text is None else text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "text.format", StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None:
        raise bad_request("`text.format` of type 'json_schema' needs `schema`; add it or use type 'json_object'.",
                          param="text.format.schema")
    return "text.format", StructuredOutputsParams(json=fmt.json_schema)


def _in_progress(req: ResponsesRequest, model: str) -> Response:
    """The response object as it stands before any output."""
    return Response(id=new_id("resp"), created_at=int(time.time()), model=model, status="in_progress", output=[],
                    instructions=req.instructions, max_output_tokens=req.max_output_tokens,
                    metadata=req.metadata or {}, parallel_tool_calls=req.parallel_tool_calls is not False,
                    previous_response_id=req.previous_response_id, reasoning=req.reasoning,
                    background=bool(req.background),
                    store=req.store is not False, temperature=req.temperature, text=req.text or TextOptions(),
                    tool_choice=req.tool_choice or "auto", tools=req.tools or [], top_p=req.top_p,
                    truncation=req.truncation or "disabled", top_logprobs=req.top_logprobs,
                    user=UNSET if req.user is None else req.user)


def _store(store: ResponseStore, req: ResponsesRequest, turn: list[ChatMessage], response: Response) -> None:
    items = input_items(req.input)
    size = len(_encoder.encode(items)) + len(_encoder.encode(response))
    store.put(StoredResponse(response, items, turn + [_assistant(response)], size))


def _keep_nothing(response: Response) -> None:
    """What `store: false` keeps of a response."""


def _assistant(response: Response) -> ChatMessage:
    """The response's output as the assistant message a next turn's chat holds."""
    message = ChatMessage("assistant", None, tool_calls=[])
    for item in response.output:
        if item.__struct_config__.tag == "message":
            message.content = "".join(part.text for part in item.content)
        elif item.__struct_config__.tag == "reasoning":
            message.reasoning = "".join(part.text for part in item.content)
        else:
            message.tool_calls.append(ToolCallIn(FunctionCallIn(item.name, item.arguments), id=item.call_id))
    message.tool_calls = message.tool_calls or None
    return message


def input_items(given: str | list[InputItem]) -> list[dict]:
    """The input as the input_items route lists it: items with ids (made up where the client sent none)."""
    if isinstance(given, str):
        given = [InputItem(role="user", content=given)]
    listed = []
    for item in given:
        entry = {k: v for k, v in msgspec.to_builtins(item).items() if v is not None}
        entry["type"] = item.type
        entry.setdefault("id", new_id(_ITEM_PREFIX.get(item.type, "item")))
        if isinstance(item.content, str) and item.type == "message":
            # A message's text as OpenAI lists it: one input_text part (output_text for the assistant's).
            part = "output_text" if item.role == "assistant" else "input_text"
            entry["content"] = [{"type": part, "text": item.content}]
        listed.append(entry)
    return listed
