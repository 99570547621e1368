"""chat_fit.fit: the fewest oldest turns dropped that make a chat fit, the system messages and the
last turn kept."""
import pytest

from pagedserve.gateway.chat_fit import fit
from pagedserve.gateway.schemas import ChatMessage


def _chat(*roles_and_lengths: tuple[str, int]) -> list[ChatMessage]:
    return [ChatMessage(role, "x" * length) for role, length in roles_and_lengths]


async def _render(messages: list[ChatMessage]) -> list[int]:
    _render.calls += 1
    return [0] * sum(len(m.content) for m in messages)


@pytest.mark.parametrize("limit, kept", [
    (100, [0, 1, 2, 3, 4, 5, 6]),   # fits whole
    (65, [0, 3, 4, 5, 6]),          # the first turn goes
    (60, [0, 5, 6]),                # two go
    (20, [0, 5, 6]),                # the last turn stays, fit or not
])
async def test_fit_drops_as_few_oldest_turns_as_fit(limit, kept):
    chat = _chat(("system", 5), ("user", 10), ("assistant", 10), ("user", 10), ("tool", 10), ("user", 20),
                 ("assistant", 20))
    _render.calls = 0
    prompt = await fit(chat, limit, _render)
    assert len(prompt) == sum(len(chat[i].content) for i in kept)
    assert _render.calls <= 4


async def test_a_single_turn_is_never_cut():
    chat = _chat(("developer", 5), ("user", 50), ("assistant", 5), ("tool", 5))
    assert len(await fit(chat, 10, _render)) == 65
