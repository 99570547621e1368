"""HTTP handlers of the OpenAI routes: /v1/models, /v1/completions and /v1/chat/completions."""
from dataclasses import replace

from aiohttp import web

from pagedserve.gateway import params
from pagedserve.gateway.chat_responses import ChatResponses, CompletionResponses, Extensions, PromptLogprobs
from pagedserve.gateway.admission import engine_route, served_for
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.request_plan import TOP_LOGPROBS_NAMES, NeutralRequest, Plan, plan
from pagedserve.gateway.schemas import ChatCompletionRequest, CompletionRequest, Model, ModelList, SamplingFields
from pagedserve.gateway.serving import json_response, read_json, run
from pagedserve.gateway.state import GATEWAY, Gateway, ServedModel
from pagedserve.gateway.structured import request_constraint


def _card(gateway: Gateway, served: ServedModel, parent: str | None = None) -> Model:
    """A model's card; an adapter's names the model it runs on as `parent` (vLLM's)."""
    return Model(id=served.name, created=gateway.started, max_model_len=served.spec.max_model_len,
                 parent=parent)


async def list_models(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    cards = []
    for served in await gateway.served_models():
        cards.append(_card(gateway, served))
        cards += [_card(gateway, served.named(name), served.name) for name in served.spec.lora_names]
    return json_response(ModelList(cards))


async def get_model(request: web.Request) -> web.Response:
    served = await served_for(request, request.match_info["model"])
    parent = served.aliases[0] if served.lora_name else None
    return json_response(_card(request.app[GATEWAY], served, parent))


@engine_route
async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await read_json(request, ChatCompletionRequest)
    p, wire = await chat_plan(request.app[GATEWAY], await served_for(request, req.model), req)
    return await run(request, p, wire)


async def chat_plan(gateway: Gateway, served: ServedModel, req: ChatCompletionRequest,
                    background: bool = False) -> tuple[Plan, ChatResponses]:
    """A chat completion request's plan and wire (the route's and a batch line's); a 400 APIError
    for what cannot run."""
    params.check_chat_options(req)
    neutral = NeutralRequest(req, messages=req.messages, tools=req.tools, tool_choice=req.tool_choice,
                             parallel_tool_calls=req.parallel_tool_calls, constraint=request_constraint(req),
                             max_tokens=req.max_completion_tokens or req.max_tokens,
                             logprobs=params.chat_logprobs(req), prompt_logprobs=req.prompt_logprobs,
                             include_usage=_include_usage(req, gateway), chat_template_kwargs=_template_kwargs(req),
                             chat_template=req.chat_template, add_generation_prompt=req.add_generation_prompt,
                             continue_final_message=req.continue_final_message, documents=req.documents,
                             add_special_tokens=req.add_special_tokens,
                             background=background, field_names=TOP_LOGPROBS_NAMES)
    p = await plan(gateway, served, neutral)
    prompt_lp = None
    if req.prompt_logprobs is not None:
        if req.stream:
            raise bad_request("`prompt_logprobs` on chat completions is returned without `stream` only; "
                              "remove one of them.", param="prompt_logprobs")
        prompt_lp = PromptLogprobs(vllm=True, echo=False)
    shown = replace(p.options, reasoning=p.options.reasoning if req.include_reasoning else None)
    wire = ChatResponses(p.id, p.model, len(p.choices), p.include_usage, neutral.logprobs is not None, shown,
                         _extensions(req, p, prompt_lp), params.chat_echo(req),
                         params.chat_role(req, gateway.response_role))
    return p, wire


@engine_route
async def completions(request: web.Request) -> web.StreamResponse:
    req = await read_json(request, CompletionRequest)
    p, wire = await completion_plan(request.app[GATEWAY], await served_for(request, req.model), req)
    return await run(request, p, wire)


async def completion_plan(gateway: Gateway, served: ServedModel, req: CompletionRequest,
                          background: bool = False) -> tuple[Plan, CompletionResponses]:
    """A completion request's plan and wire (the route's and a batch line's); a 400 APIError for
    what cannot run."""
    params.check_completion_options(req)
    # Echo with logprobs shows the prompt's tokens as OpenAI does, prompt_logprobs as vLLM does.
    asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    prompt_logprobs = max(asked) if asked else None
    given = params.split_prompts(req.prompt)
    neutral = NeutralRequest(req, prompts=given, constraint=request_constraint(req), max_tokens=req.max_tokens,
                             logprobs=req.logprobs, prompt_logprobs=prompt_logprobs,
                             include_usage=_include_usage(req, gateway), background=background)
    p = await plan(gateway, served, neutral)
    echo = [""] * len(p.choices)
    if req.echo:
        # A truncated prompt echoes what the model read.
        shown = given if req.truncate_prompt_tokens is None else p.prompts
        echo = [await _echo_text(gateway, p, shown[c.index // req.n]) for c in p.choices]
    prompt_lp = None
    if prompt_logprobs is not None:
        prompt_lp = PromptLogprobs(vllm=req.prompt_logprobs is not None,
                                   echo=bool(req.echo and req.logprobs is not None))
    wire = CompletionResponses(p.id, p.model, len(p.choices), p.include_usage, req.logprobs is not None,
                               echo, _extensions(req, p, prompt_lp))
    return p, wire


async def _echo_text(gateway: Gateway, p: Plan, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return await gateway.offload(len(prompt), p.tokenizer.decode, prompt)


def _template_kwargs(req: ChatCompletionRequest) -> dict | None:
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": req.reasoning_effort, **(req.chat_template_kwargs or {})}


def _include_usage(req: SamplingFields, gateway: Gateway) -> bool:
    return gateway.force_include_usage or (req.stream_options is not None and req.stream_options.include_usage)


def _extensions(req: SamplingFields, p: Plan, prompt: PromptLogprobs | None) -> Extensions:
    continuous = p.include_usage and req.stream_options is not None and req.stream_options.continuous_usage_stats
    return Extensions(prompt, p.generation.choice_usage if continuous else None,
                      [c.prompt_token_ids for c in p.choices] if req.return_token_ids else None)
