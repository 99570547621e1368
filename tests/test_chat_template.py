"""continue_final: a rendered chat cut where its final message ends, as transformers cuts it; which
templates take a message's content as parts."""
import pytest

from pagedserve.common.chat_template import ChatTemplateError, content_format, continue_final


@pytest.mark.parametrize("text, final, expected", [
    ("<u>hi\n<a>Sure, \n", "Sure, ", "<u>hi\n<a>Sure, "),       # the template kept the trailing space
    ("<u>hi\n<a>Sure,</a>\n", "Sure, ", "<u>hi\n<a>Sure,"),     # the template trimmed it
    ("<u>Sure\n<a>Sure</a>", "Sure", "<u>Sure\n<a>Sure"),       # the last occurrence is the message's
    ("<u>hi\n<a> Sure</a>", "  Sure", "<u>hi\n<a> Sure"),       # leading spaces as the template wrote them
])
def test_continue_final_cuts_the_render_where_the_final_message_ends(text, final, expected):
    assert continue_final(text, final) == expected


@pytest.mark.parametrize("final", [None, "", "  ", "not in the render"])
def test_continue_final_refuses_a_message_the_render_does_not_hold(final):
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        continue_final("<u>hi\n<a></a>", final)


@pytest.mark.parametrize("source, expected", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    # Through a test and a filter, as Gemma's and Llama 4's templates read it.
    ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content | "
     "selectattr('type', 'equalto', 'text') %}{{ c.text }}{% endfor %}{% endif %}{% endfor %}", "openai"),
    # Through a variable set from messages.
    ("{% set rest = messages[1:] %}{% for m in rest %}{% for c in m.content %}{% endfor %}{% endfor %}", "openai"),
    # Loops over something else's content, or over one message picked by index: vLLM reads those as strings too.
    ("{% for x in tools %}{% for c in x.content %}{% endfor %}{% endfor %}", "string"),
    ("{% for c in messages[0]['content'] %}{{ c }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for c in m.tool_calls %}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %", "string"),
])
def test_content_format_is_openai_where_the_template_loops_over_a_messages_content(source, expected):
    assert content_format(source) == expected
