"""vLLM's /tokenize and /detokenize: the requested model's tokenizer and chat template, no generation."""
from aiohttp import web

from pagedserve.gateway import params
from pagedserve.gateway.chat_prompt import chat_prompt
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.admission import served_for
from pagedserve.gateway.serving import json_response, read_json
from pagedserve.gateway.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from pagedserve.gateway.state import GATEWAY


async def tokenize(request: web.Request) -> web.Response:
    req = await read_json(request, TokenizeRequest)
    gateway = request.app[GATEWAY]
    served = await served_for(request, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("Send exactly one of `prompt` (text) or `messages` (a chat).", param="prompt")
    if req.messages is not None:
        chat = params.chat_input(req.messages, req.tools, req.chat_template_kwargs, req.chat_template,
                                 gateway.trust_request_chat_template, req.continue_final_message)
        tokens = await chat_prompt(gateway, served.tokenizer, chat, req.add_generation_prompt, bool(req.add_special_tokens))
    else:
        params.check_prompt_chars(len(req.prompt), "prompt")
        tokens = await gateway.offload(len(req.prompt), served.tokenizer.encode, req.prompt,
                                       req.add_special_tokens is not False)
    reply = TokenizeResponse(len(tokens), served.spec.max_model_len, tokens)
    if req.return_token_strs:
        reply.token_strs = served.tokenizer.token_strings(tokens)
    return json_response(reply)


async def detokenize(request: web.Request) -> web.Response:
    req = await read_json(request, DetokenizeRequest)
    gateway = request.app[GATEWAY]
    tokenizer = (await served_for(request, req.model)).tokenizer
    params.check_token_ids(req.tokens, tokenizer.vocab_size, "tokens")
    # Special tokens are kept, so that detokenize(tokenize(text)) shows exactly what the model sees.
    text = await gateway.offload(len(req.tokens), tokenizer.decode, req.tokens, False)
    return json_response(DetokenizeResponse(text))
