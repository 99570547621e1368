"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, a translator between its
wire and the request plan. The `anthropic-version` and `anthropic-beta` headers are accepted and read
for nothing: the one version of the API this serves is the current one."""
import msgspec
from aiohttp import web

from pagedserve.gateway import anthropic_request as translate
from pagedserve.gateway import params
from pagedserve.gateway.admission import engine_route, served_for
from pagedserve.gateway.anthropic_output import MessageWire, error_body
from pagedserve.gateway.anthropic_schemas import (CountTokensRequest, CountTokensResponse, MessagesRequest,
                                                  event_name)
from pagedserve.gateway.chat_prompt import chat_prompt
from pagedserve.gateway.errors import APIError
from pagedserve.gateway.request_plan import NeutralRequest, plan
from pagedserve.gateway.schemas import SamplingFields
from pagedserve.gateway.serving import json_response, read_json, run
from pagedserve.gateway.sse import SSEWriter
from pagedserve.gateway.state import GATEWAY

_encoder = msgspec.json.Encoder()


def encode_error(error: APIError) -> bytes:
    return _encoder.encode(error_body(error))


class MessageEvents(SSEWriter):
    """Anthropic's framing of server-sent events: an `event: <type>` line before each data line, and
    no [DONE] at the end."""

    async def send(self, event: msgspec.Struct) -> None:
        await self.response.write(b"event: %s\ndata: %s\n\n" % (event_name(event).encode(), _encoder.encode(event)))

    async def close(self) -> None:
        await self.response.write_eof()


def neutral(req: MessagesRequest) -> NeutralRequest:
    """The request in chat's terms; a 400 for what cannot run here."""
    continues = translate.prefill(req)
    sampling = SamplingFields(model=req.model, max_tokens=req.max_tokens, temperature=req.temperature,
                              top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences, stream=req.stream)
    return NeutralRequest(sampling, messages=translate.chat_messages(req), tools=translate.chat_tools(req.tools),
                          tool_choice=translate.chat_tool_choice(req.tool_choice),
                          parallel_tool_calls=translate.parallel_tool_calls(req.tool_choice),
                          constraint=translate.constraint(req.output_config), max_tokens=req.max_tokens,
                          chat_template_kwargs=translate.template_kwargs(req.thinking, req.output_config),
                          continue_final_message=continues, add_generation_prompt=not continues)


@engine_route
async def messages(request: web.Request) -> web.StreamResponse:
    req = await read_json(request, MessagesRequest)
    gateway = request.app[GATEWAY]
    p = await plan(gateway, await served_for(request, req.model), neutral(req))
    return await run(request, p, MessageWire(f"msg_{p.id}", p.model, p.generation.usage), MessageEvents.open)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's length in tokens: the chat template rendered with the tools, then tokenized."""
    req = await read_json(request, CountTokensRequest)
    gateway = request.app[GATEWAY]
    served = await served_for(request, req.model)
    continues = translate.prefill(req)
    chat = params.chat_input(translate.chat_messages(req), translate.chat_tools(req.tools),
                             translate.template_kwargs(req.thinking, req.output_config), None,
                             gateway.trust_request_chat_template, continues)
    prompt = await chat_prompt(gateway, served.tokenizer, chat, add_generation_prompt=not continues)
    return json_response(CountTokensResponse(len(prompt)))
