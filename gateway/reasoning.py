"""--reasoning-parser: the thinking of a reasoning model (<think>…</think>) apart from its answer.

deepseek_r1: everything before </think> is reasoning, with or without <think> (newer templates
put <think> in the prompt). qwen3: the same; with enable_thinking off the template closes the
thinking in the prompt itself, and a prompt whose last think tag is </think> makes the whole
output the answer (vLLM detects it the same way, from the prompt). Like the tool parsers, a split
of a longer text extends the previous split's parts, so a stream sends their new suffixes."""
from pagedserve.gateway.tool_parsers import held_back

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def ended_in_prompt(prompt: str) -> bool:
    """Whether the prompt itself closes the thinking (its last think tag is </think>)."""
    return prompt.rfind(END) > prompt.rfind(START)


def split(text: str, final: bool) -> tuple[str, str | None]:
    """(reasoning, answer) of the output so far; answer None while the thinking is still open.
    Not final, a suffix that may begin </think> is held back."""
    if text.lstrip().startswith(START):
        text = text.lstrip()[len(START):]
    elif not final and START.startswith(text.lstrip()):
        return "", None
    end = text.find(END)
    if end < 0:
        return text[:len(text) - (0 if final else held_back(text, END))], None
    return text[:end], text[end + len(END):].lstrip()
