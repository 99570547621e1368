"""continue_final: a rendered chat cut where its final message ends, as transformers cuts it."""
import pytest

from pagedserve.common.chat_template import ChatTemplateError, continue_final


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
