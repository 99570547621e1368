"""A chat's prompt token ids: its chat template rendered, then tokenized, never holding the event loop.

The server's own template is the operator's code: it renders inline below OFFLOAD_SIZE characters of
input (SmolLM2's renders 8 short messages in 0.1 ms), on the gateway's pool above. A request's
template (--trust-request-chat-template) is the client's code and renders in the template worker,
under its deadline and memory limit, whatever its size."""
from pagedserve.common.chat_template import ChatTemplateError, continue_final
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.params import ChatInput
from pagedserve.gateway.state import Gateway


async def chat_prompt(gateway: Gateway, tokenizer: Tokenizer, chat: ChatInput, add_generation_prompt: bool,
                      add_special_tokens: bool = False) -> list[int]:
    """The token ids of the rendered chat; a 400 when the template refuses or fails. The template
    writes the special tokens (BOS included), so add_special_tokens=True would add them twice
    (vLLM's /tokenize offers it all the same)."""
    if chat.continue_final and add_generation_prompt:
        raise bad_request("`continue_final_message` continues the last message and `add_generation_prompt` starts "
                          "a new one; set `add_generation_prompt` to false.", param="continue_final_message")
    form = tokenizer.content_format(chat.template, gateway.content_format)
    try:
        if chat.template is None:
            return await gateway.offload(chat.size, _render_and_encode, tokenizer, chat, form, add_generation_prompt,
                                         add_special_tokens)
        variables = _variables(tokenizer, chat, form, add_generation_prompt)
        text = _continued(chat, form, await gateway.templates.render(chat.template, variables))
    except ChatTemplateError as e:
        raise bad_request(f"Cannot build a prompt from these messages: {e}",
                          param="messages" if chat.template is None else "chat_template") from e
    return await gateway.offload(len(text), tokenizer.encode, text, add_special_tokens)


def _render_and_encode(tokenizer: Tokenizer, chat: ChatInput, form: str, add_generation_prompt: bool,
                       add_special_tokens: bool) -> list[int]:
    text = tokenizer.render_chat(_variables(tokenizer, chat, form, add_generation_prompt))
    return tokenizer.encode(_continued(chat, form, text), add_special_tokens=add_special_tokens)


def _variables(tokenizer: Tokenizer, chat: ChatInput, form: str, add_generation_prompt: bool) -> dict:
    return tokenizer.chat_variables(chat.template_messages(form), add_generation_prompt, chat.tools,
                                    chat.template_kwargs, chat.documents)


def _continued(chat: ChatInput, form: str, text: str) -> str:
    return continue_final(text, chat.continued_text(form)) if chat.continue_final else text
