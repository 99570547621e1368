"""The Phi-3, Phi-3.5 and Phi-4 chat templates (their tokenizer_config.json's, and llama.cpp's
Phi-4-mini one with tool calls) render as transformers renders them."""
import pytest
from transformers import AutoTokenizer

from pagedserve.common.tokenizer import ChatTemplateError, Tokenizer

PHI_3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + "
         "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + "
         "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' "
         "+ message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}"
         "{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
PHI_3_5 = PHI_3.replace("{% if message['role'] == 'system' %}",
                        "{% if message['role'] == 'system' and message['content'] %}")
PHI_4 = ("{% for message in messages %}{% if (message['role'] == 'system') %}{{'<|im_start|>system<|im_sep|>' "
         "+ message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'user') %}"
         "{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}{% elif (message['role'] == "
         "'assistant') %}{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}")
PHI_4_MINI = ("{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
              "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + "
              "'<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] "
              "+ '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")
# llama.cpp's models/templates/llama-cpp-microsoft-Phi-4-mini-instruct.jinja: tools and tool calls.
PHI_4_MINI_LLAMA_CPP = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
{% elif tools is defined -%}
    {%- set system_message = "" -%}
{%- endif %}

{%- if system_message is defined -%}
    {{- '<|system|>' + system_message -}}
    {%- if tools is defined -%}
        {% for tool in tools %}
            {{- '<|tool|>' + (tool['function'] | tojson) + '<|/tool|>' -}}
        {% endfor %}
        {%- if '<|tool_call|>' not in system_message -%}
            {{- 'You are a helpful assistant with some tools.\\nTo use a tool, respond in this format: <|tool_call|>{"name": "foo", "arguments": {"a": 1}}<|/tool_call|>' -}}
        {%- endif -%}
    {%- endif -%}
    {{- '<|end|>' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'tool' -%}
        {{- '<|tool_response|>' + (message['content'] | tojson) + '<|end|>' -}}
    {%- elif message['role'] != 'system' -%}
        {{- '<|' + message['role'] + '|>' -}}
        {%- if message.content -%}
            {{- message['content'] -}}
        {%- endif -%}  
        {%- for tool_call in message.tool_calls -%}
            {{- '<|tool_call|>' + (tool_call['function'] | tojson) + '<|/tool_call|>' -}}
        {%- endfor -%}
        {{- '<|end|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
   {{- '<|assistant|>' -}}
{%- else -%}
   {{- eos_token -}}
{%- endif -%}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 😀"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And now?"}]
TOOL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"}]
# template, messages, tools
CASES = {
    "phi-3": (PHI_3, CHAT, None),
    "phi-3.5-empty-system": (PHI_3_5, [{"role": "system", "content": ""}, *CHAT[1:]], None),
    "phi-3.5": (PHI_3_5, CHAT, None),
    "phi-4": (PHI_4, CHAT, None),
    "phi-4-mini": (PHI_4_MINI, CHAT, None),
    "phi-4-mini-system-tools": (PHI_4_MINI, [{**CHAT[0], "tools": '[{"name": "get_weather"}]'}, *CHAT[1:]], None),
    "phi-4-mini-llama-cpp-tools": (PHI_4_MINI_LLAMA_CPP, TOOL_CHAT, [WEATHER]),
}


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["prompt", "no-prompt"])
@pytest.mark.parametrize("case", CASES)
def test_phi_templates_render_as_transformers(tokenizer_dir, case, add_generation_prompt):
    template, messages, tools = CASES[case]
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    expected = reference.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    ours = Tokenizer.from_dir(tokenizer_dir).apply_chat_template(
        messages, add_generation_prompt, tools=tools, template=template)
    assert ours == expected


def test_llama_cpp_phi_4_mini_template_needs_tools_in_both(tokenizer_dir):
    # It tests `tools is defined`, which holds for tools=None too, then iterates them.
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    with pytest.raises(TypeError, match="'NoneType' object is not iterable"):
        reference.apply_chat_template(CHAT, chat_template=PHI_4_MINI_LLAMA_CPP, tokenize=False)
    with pytest.raises(ChatTemplateError, match="'NoneType' object is not iterable"):
        Tokenizer.from_dir(tokenizer_dir).apply_chat_template(CHAT, template=PHI_4_MINI_LLAMA_CPP)
