"""A chat too long for the context loses its oldest turns: Responses' truncation "auto", as OpenAI's
API drops items from the beginning of the conversation, and Ollama's chat, which drops old messages.
Whole turns go, so that the prompt stays well formed (vLLM's truncation "auto" cuts the prompt's
first tokens instead, its template's header with them)."""
from collections.abc import Awaitable, Callable

from pagedserve.gateway.schemas import ChatMessage

Render = Callable[[list[ChatMessage]], Awaitable[list[int]]]


async def fit(messages: list[ChatMessage], limit: int, render: Render) -> list[int]:
    """The prompt of `messages` where it holds at most `limit` tokens; else that of the chat without
    as few of its oldest turns as make it fit. A turn starts at a user message; the leading system
    and developer messages stay, and so does the last turn, fit or not (the caller's length check
    then refuses it). Renders O(log turns) times."""
    prompt = await render(messages)
    if len(prompt) <= limit:
        return prompt
    head = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    starts = [i for i in range(head + 1, len(messages)) if messages[i].role == "user"]
    if not starts:
        return prompt
    rendered: dict[int, list[int]] = {}
    low, high = 0, len(starts) - 1
    while low <= high:
        middle = (low + high) // 2
        rendered[middle] = await render(messages[:head] + messages[starts[middle]:])
        if len(rendered[middle]) <= limit:
            high = middle - 1
        else:
            low = middle + 1
    last = min(low, len(starts) - 1)
    return rendered.get(last) or await render(messages[:head] + messages[starts[last]:])
