"""SEC-13: crafted inputs that used to raise inside the gateway (a 500 and a traceback logged at error
level) get a one-line 400 naming the field, and nothing is logged as a crash."""
import json

import pytest

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
DEEP_IFS = "{% if true %}" * 200 + "x" + "{% endif %}" * 200
RECURSIVE = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
CASES = {
    "superscript digit key": ({"logit_bias": {"²": 1}}, "logit_bias"),
    "double minus key": ({"logit_bias": {"--5": 1}}, "logit_bias"),
    "5000-digit key": ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    **{f"kwargs key {key}": ({"chat_template_kwargs": {key: 1}}, "chat_template_kwargs")
       for key in ("tools", "messages", "add_generation_prompt", "bos_token")},
    "template raising OverflowError": ({"chat_template": "{{ range(10**6) }}"}, "chat_template"),
    "template raising IndentationError": ({"chat_template": DEEP_IFS}, "chat_template"),
    "template raising RecursionError": ({"chat_template": RECURSIVE}, "chat_template"),
    "JSON nested 1000 deep": ({"chat_template_kwargs": {"x": [[]]}}, None),
}


def _body(fields: dict) -> bytes:
    if fields.get("chat_template_kwargs") == {"x": [[]]}:
        nested = "[" * 1000 + "]" * 1000
        return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
                f'"chat_template_kwargs": {{"x": {nested}}}}}').encode()
    return json.dumps({"messages": MSG, "max_tokens": 1, **fields}).encode()


@pytest.mark.parametrize("case", CASES)
async def test_a_crafted_input_is_a_400_not_a_crash(http, serve, capsys, case):
    fields, param = CASES[case]
    url = await serve(trust_request_chat_template="chat_template" in fields)
    async with http.post(url + CHAT, data=_body(fields), headers={"Content-Type": "application/json"}) as r:
        status, error = r.status, (await r.json())["error"]
    assert status == 400 and error["param"] == param
    assert "\n" not in error["message"] and len(error["message"]) < 500
    logged = capsys.readouterr()
    assert "request_crashed" not in logged.out + logged.err


async def test_a_kwarg_that_is_no_template_variable_is_passed_on(http, base_url):
    # `template` collided with a parameter of apply_chat_template (a TypeError); it is only a variable.
    async with http.post(base_url + CHAT, json={"messages": MSG, "max_tokens": 1,
                                                "chat_template_kwargs": {"template": "x"}}) as r:
        assert r.status == 200


@pytest.mark.parametrize("source, variables", [("{{ range(10**6) }}", {}), (RECURSIVE, {}),
                                               ("{{ x.y.z }}", {"x": 1}), ("{{ 1 / 0 }}", {})])
def test_the_servers_own_template_failing_is_a_chat_template_error(source, variables):
    from pagedserve.common.chat_template import ChatTemplateError, compile_template, render
    with pytest.raises(ChatTemplateError):
        render(compile_template(source), variables)


def test_a_template_nested_too_deeply_does_not_compile():
    from pagedserve.common.chat_template import ChatTemplateError, compile_template
    with pytest.raises(ChatTemplateError, match="does not compile"):
        compile_template(DEEP_IFS)
