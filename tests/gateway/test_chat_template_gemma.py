"""Gemma 2's and Gemma 3's chat templates (byte for byte llama.cpp's models/templates copies of
google/gemma-2-2b-it's and the gemma-3 -it models') render as transformers renders them, and
where transformers raises (Gemma 2 has no system role; both want alternating turns) the gateway
answers a 400 naming `messages` with the template's own words."""
import re
from pathlib import Path

import jinja2
import pytest
import transformers

from pagedserve.common.tokenizer import ChatTemplateError, Tokenizer
from tests.gateway.fake_engine import serve_live_gateway

TEMPLATES = {name: (Path(__file__).parent / "templates" / f"{name}.jinja").read_text()
             for name in ("google-gemma-2-2b-it", "google-gemma-3-4b-it")}
SYSTEM = {"role": "system", "content": "You are terse."}
CHATS = {
    "one turn": [{"role": "user", "content": "  Hello!\n"}],
    "several turns": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello. "},
                      {"role": "user", "content": "What is 2+2?"}],
    "system first": [SYSTEM, {"role": "user", "content": "Hi"}],
    "text parts": [{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                                {"type": "text", "text": "this."}]}],
    "turns out of order": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}


@pytest.fixture(scope="module")
def reference(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("template", TEMPLATES)
def test_renders_as_transformers_renders(tokenizer_dir, reference, template, chat, add_generation_prompt):
    ours = Tokenizer.from_dir(tokenizer_dir, chat_template=TEMPLATES[template])
    messages = CHATS[chat]
    try:
        expected = reference.apply_chat_template(messages, chat_template=TEMPLATES[template], tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as refused:
        with pytest.raises(ChatTemplateError, match=re.escape(str(refused))):
            ours.apply_chat_template(messages, add_generation_prompt)
        return
    assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_only_gemma_3_takes_a_system_message(tokenizer_dir):
    gemma2, gemma3 = (Tokenizer.from_dir(tokenizer_dir, chat_template=t) for t in TEMPLATES.values())
    assert gemma3.apply_chat_template(CHATS["system first"]) == (
        "<s><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        gemma2.apply_chat_template(CHATS["system first"])


@pytest.mark.parametrize("chat, says", [("system first", "System role not supported"),
                                        ("turns out of order", "Conversation roles must alternate")])
async def test_what_gemma_2_refuses_is_a_400_naming_messages(http, engine, tokenizer_dir, chat, says):
    tokenizer = Tokenizer.from_dir(tokenizer_dir, chat_template=TEMPLATES["google-gemma-2-2b-it"])
    runner, url = await serve_live_gateway(tokenizer, engine.address)
    try:
        async with http.post(f"{url}/v1/chat/completions", json={"messages": CHATS[chat]}) as r:
            status, error = r.status, (await r.json())["error"]
    finally:
        await runner.cleanup()
    assert status == 400 and error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert says in error["message"]
    assert engine.requests == []
