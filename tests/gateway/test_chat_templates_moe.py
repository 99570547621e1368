"""The chat templates of the mixture-of-experts families render as transformers renders them:
Qwen3-MoE's (Qwen3's: tools, tool calls and responses, thinking) and Mixtral's (Mistral's
[INST] template, which refuses a tool turn or roles that do not alternate)."""
import json
from pathlib import Path

import pytest
import transformers

from pagedserve.common.tokenizer import ChatTemplateError, Tokenizer
from tests.gateway.test_tokenizer import _copy

# Each template as the model's tokenizer_config.json holds it (Qwen/Qwen3-30B-A3B,
# mistralai/Mixtral-8x7B-Instruct-v0.1).
TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}
CHATS = {
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 😀"}],
    "multi_turn": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"},
                   {"role": "user", "content": "And now?"}],
    "tools": [{"role": "user", "content": "Weather in Oslo?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "content": "12 C, rain"}],
}


def template_dir(tmp_path, tokenizer_dir, name: str, **tokens) -> Path:
    template = (TEMPLATES / f"{name}.jinja").read_text().removesuffix("\n")
    return _copy(tokenizer_dir, tmp_path, chat_template=template, **tokens)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("options", [{}, {"enable_thinking": False}, {"add_generation_prompt": False}],
                         ids=["generation_prompt", "no_thinking", "no_generation_prompt"])
def test_qwen3_template_renders_as_transformers(tokenizer_dir, tmp_path, chat, options):
    path = template_dir(tmp_path, tokenizer_dir, "qwen3", bos_token=None, eos_token="<|im_end|>")
    messages, tools = CHATS[chat], TOOLS if chat == "tools" else None
    options = {"add_generation_prompt": True, **options}
    ours = Tokenizer.from_dir(path).apply_chat_template(messages, tools=tools, **options)
    reference = transformers.AutoTokenizer.from_pretrained(path)
    assert ours == reference.apply_chat_template(messages, tools=tools, tokenize=False, **options)
    assert ours.startswith("<|im_start|>")
    if tools:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in ours
        assert "<tool_response>\n12 C, rain\n</tool_response>" in ours


@pytest.mark.parametrize("chat", ["system", "multi_turn"])
def test_mixtral_template_renders_as_transformers(tokenizer_dir, tmp_path, chat):
    path = template_dir(tmp_path, tokenizer_dir, "mixtral")
    ours = Tokenizer.from_dir(path).apply_chat_template(CHATS[chat])
    reference = transformers.AutoTokenizer.from_pretrained(path)
    assert ours == reference.apply_chat_template(CHATS[chat], tokenize=False, add_generation_prompt=True)
    assert ours.startswith("<s> [INST] Be brief.\n\n")


def test_mixtral_template_refuses_what_transformers_refuses(tokenizer_dir, tmp_path):
    path = template_dir(tmp_path, tokenizer_dir, "mixtral")
    reference = transformers.AutoTokenizer.from_pretrained(path)
    with pytest.raises(Exception, match="must alternate"):
        reference.apply_chat_template(CHATS["tools"], tokenize=False)
    with pytest.raises(ChatTemplateError, match="must alternate user/assistant"):
        Tokenizer.from_dir(path).apply_chat_template(CHATS["tools"])
