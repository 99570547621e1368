"""The request every generation route builds, whatever its protocol, and plan(): that request
checked and turned into engine requests (the prompt, the choices, how their output is read).

A protocol's handler is a translator: its body to a NeutralRequest, then output_events to its wire."""
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.gateway import chat_fit, params, reasoning
from pagedserve.gateway.admission import check_runner
from pagedserve.gateway.chat_output import ChatOutputOptions, ChoiceOutput
from pagedserve.gateway.chat_prompt import chat_prompt
from pagedserve.gateway.engine_client import Routing
from pagedserve.gateway.errors import APIError, bad_request
from pagedserve.gateway.beam_search import BeamSearch, beam_search
from pagedserve.gateway.generation import Choice, Generation, fan_out
from pagedserve.gateway.request_id import current_request_id
from pagedserve.gateway.schemas import ChatMessage, NamedToolChoice, SamplingFields, Tool
from pagedserve.gateway.state import Gateway, ServedModel
from pagedserve.gateway.structured import checked
from pagedserve.gateway.tools import tool_options

ToolChoice = str | NamedToolChoice | None


# The field names of chat and Ollama, which call the top logprobs a token `top_logprobs`.
TOP_LOGPROBS_NAMES = {"logprobs": "top_logprobs"}


@dataclass(slots=True)
class NeutralRequest:
    """What a client asks for, in OpenAI's chat terms: `messages` (a chat, rendered with the chat
    template) or `prompts` (texts or token ids, taken as they are), never both.

    `sampling` holds the generation options (its ranges are checked when it is built; its `n`,
    `stream`, `stop` and `model` are the request's); `max_tokens` is the output limit whatever the
    protocol calls it; `constraint` is the output constraint the protocol asked for (response
    format, JSON schema) and the field it came in, for errors; `logprobs` the top logprobs per
    output token (None: none)."""
    sampling: SamplingFields
    messages: list[ChatMessage] | None = None
    prompts: list[str] | list[list[int]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    constraint: tuple[str, StructuredOutputsParams] | None = None
    max_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_usage: bool = False
    # Extra chat template variables (enable_thinking, reasoning_effort), and a request's own template.
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict] | None = None
    add_special_tokens: bool = False
    # A chat too long for the context loses its oldest turns (chat_fit): Responses' truncation "auto",
    # and Ollama's chat unless it sets truncate false.
    drop_oldest_turns: bool = False
    # Batch work (a Batch API line), which the scheduler runs on the capacity interactive requests leave.
    background: bool = False
    # The protocol's names of the fields errors name (e.g. {"max_tokens": "max_output_tokens"}).
    field_names: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Plan:
    """A request ready to run: its id, the served model's name, the prompts' token ids, one engine
    request per choice, and one output reader per choice. Iterate it with output_events."""
    id: str
    model: str
    served: ServedModel
    tokenizer: Tokenizer
    prompts: list[list[int]]
    choices: list[Choice]
    options: ChatOutputOptions
    generation: Generation | BeamSearch
    stream: bool
    include_usage: bool
    outputs: list[ChoiceOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.outputs = [ChoiceOutput(self.options) for _ in self.choices]


async def plan(gateway: Gateway, served: ServedModel, req: NeutralRequest) -> Plan:
    """The engine requests for `req`; a 400 (APIError) for what cannot run, naming the field by
    the protocol's name for it, in its `param` and its message."""
    try:
        return await _plan(gateway, served, req)
    except APIError as e:
        name = req.field_names.get(e.info.param)
        if name is not None:
            e.info.message = re.sub(rf"(?<![\w-]){re.escape(e.info.param)}(?![\w-])", name, e.info.message)
            e.info.param = name
        raise


async def _plan(gateway: Gateway, served: ServedModel, req: NeutralRequest) -> Plan:
    check_runner(served, "generate", "text generation")
    options = _output_options(req, gateway.reasoning_parser)
    max_tokens = params.max_tokens(req.max_tokens, served.sampling_defaults.get("max_tokens"), served.max_tokens_cap)
    if req.messages is not None:
        params.check_fan_out(1, req.sampling.n, gateway.max_client_batch_size)
        constraint = await _checked(gateway, _chat_constraint(req, gateway, options))
        # The most prompt tokens that leave room for the output (at least one token of it).
        limit = served.spec.max_model_len - (max_tokens or 1)
        prompts = [await _chat_prompt(gateway, served.tokenizer, req, options, constraint, limit)]
    else:
        given = params.split_prompts(req.prompts)
        params.check_fan_out(len(given), req.sampling.n, gateway.max_client_batch_size)
        prompts = await _encoded(gateway, served.tokenizer, given)
        constraint = await _checked(gateway, req.constraint)
    keep = params.truncation(req.sampling.truncate_prompt_tokens, served.spec.max_model_len)
    if keep is not None:
        prompts = [prompt[-keep:] for prompt in prompts]
    rid = uuid.uuid4().hex
    choices = _choices(rid, req, prompts, served, constraint, max_tokens, options.keep_special_tokens)
    as_ids = req.sampling.return_tokens_as_token_ids
    generation = Generation(served.engines, served.tokenizer, choices, current_request_id(), served.metrics,
                            time.monotonic(), gateway.stream_interval, gateway.request_log,
                            gateway.prompt_tokens_details,
                            gateway.return_tokens_as_token_ids if as_ids is None else as_ids)
    if req.sampling.use_beam_search:
        generation = beam_search(rid, generation, req.sampling, prompts, served.tokenizer, served.spec, max_tokens,
                                 constraint is not None)
    return Plan(rid, served.name, served, served.tokenizer, prompts, choices, options, generation,
                bool(req.sampling.stream), req.include_usage)


def _output_options(req: NeutralRequest, reasoning_parser: str | None) -> ChatOutputOptions:
    """A chat's reasoning split (--reasoning-parser), before its tools set their scan."""
    if req.messages is None or reasoning_parser is None:
        return ChatOutputOptions()
    return ChatOutputOptions(reasoning=reasoning.FORMATS[reasoning_parser],
                             keep_special_tokens=reasoning_parser in reasoning.KEEP_SPECIAL_TOKENS)


async def _chat_prompt(gateway: Gateway, tokenizer: Tokenizer, req: NeutralRequest, options: ChatOutputOptions,
                       constraint: StructuredOutputsParams | None, limit: int) -> list[int]:
    """The rendered chat's token ids (without its oldest turns past `limit` tokens, where the request
    asks for that); turns the reasoning split off where the prompt closed the thinking."""
    async def render(messages: list[ChatMessage]) -> list[int]:
        chat = params.chat_input(messages, req.tools, req.chat_template_kwargs, req.chat_template,
                                 gateway.trust_request_chat_template, req.continue_final_message, req.documents)
        return await chat_prompt(gateway, tokenizer, chat, req.add_generation_prompt, req.add_special_tokens)

    prompt = await (chat_fit.fit(req.messages, limit, render) if req.drop_oldest_turns else render(req.messages))
    if options.reasoning and reasoning.ended_in_prompt(tokenizer.decode(prompt, False), options.reasoning):
        options.reasoning = None
    if options.reasoning and constraint is not None:
        _free_thinking(constraint, tokenizer, options.reasoning.end)
    return prompt


async def _encoded(gateway: Gateway, tokenizer: Tokenizer, given: list[str] | list[list[int]]) -> list[list[int]]:
    if isinstance(given[0], str):
        return await gateway.offload(sum(map(len, given)), params.encode_prompts, tokenizer, given)
    return given


def _free_thinking(constraint: StructuredOutputsParams, tokenizer: Tokenizer, end_tag: str) -> None:
    """Makes the constraint the answer's, leaving the thinking before `end_tag` (</think>) free. The
    end is found by token id, as vLLM does, so only where the tag is one token (a reasoning model's
    vocabulary); elsewhere the constraint covers the whole output."""
    end = tokenizer.encode(end_tag, add_special_tokens=False)
    if len(end) == 1:
        constraint.reasoning_end_ids = end


def _chat_constraint(req: NeutralRequest, gateway: Gateway,
                     options: ChatOutputOptions) -> tuple[str, StructuredOutputsParams] | None:
    """What tool_choice forces (from `tools`), or else what the request asks for, and its field."""
    forced = tool_options(req.tools, req.tool_choice, req.parallel_tool_calls, gateway.tool_parser, options)
    if forced is not None and req.constraint is not None:
        raise bad_request("tool_choice \"required\" or a named function constrains the output already; "
                          f"remove `{req.constraint[0]}`.", param="tool_choice")
    return ("tools", forced) if forced is not None else req.constraint


async def _checked(gateway: Gateway,
                   given: tuple[str, StructuredOutputsParams] | None) -> StructuredOutputsParams | None:
    """The constraint, checked (size and compilation) on the pool: a large one takes seconds."""
    if given is None:
        return None
    param, constraint = given
    return await gateway.in_pool(checked, constraint, param)


def _choices(rid: str, req: NeutralRequest, prompts: list[list[int]], served: ServedModel,
             constraint: StructuredOutputsParams | None, max_tokens: int | None,
             keep_special_tokens: bool) -> list[Choice]:
    sampling, spec = req.sampling, served.spec
    # The length first: it costs nothing, while the vocabulary check reads every id.
    params.check_context(prompts, max_tokens, spec.max_model_len)
    params.check_prompts(prompts, spec.vocab_size)
    params.check_token_ids(sampling.stop_token_ids or [], spec.vocab_size, "stop_token_ids")
    params.check_allowed_token_ids(sampling.allowed_token_ids, spec.vocab_size)
    bias = params.logit_bias(sampling.logit_bias, spec.vocab_size)
    params.check_stop(sampling.stop)
    bad_words = params.bad_words_ids(sampling.bad_words, served.tokenizer)
    wanted = params.sampling_params(sampling, max_tokens, req.logprobs, served.sampling_defaults, constraint,
                                    req.prompt_logprobs, bias, bad_words)
    params.check_logprobs(wanted, spec.max_logprobs)
    if keep_special_tokens:
        wanted.skip_special_tokens = False
    routing = Routing(sampling.cache_salt, sampling.priority, req.background, served.lora_name)
    choices = fan_out(rid, prompts, wanted, routing)
    served.metrics.request_params_n.observe(sampling.n)
    served.metrics.request_params_max_tokens.observe(
        max_tokens or spec.max_model_len - max(len(p) for p in prompts))
    return choices
