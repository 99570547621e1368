"""--reasoning-parser: the thinking of a reasoning model (<think>…</think>) apart from its answer.

deepseek_r1: everything before </think> is reasoning, with or without <think> (newer templates
put <think> in the prompt). qwen3: the same; with enable_thinking off the template closes the
thinking in the prompt itself, and a prompt whose last think tag is </think> makes the whole
output the answer (vLLM detects it the same way, from the prompt). Like the tool parsers, a split
of a longer text extends the previous split's parts, so a stream sends their new suffixes."""
from pagedserve.gateway.call_scan import held_back

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def ended_in_prompt(prompt: str) -> bool:
    """Whether the prompt itself closes the thinking (its last think tag is </think>)."""
    return prompt.rfind(END) > prompt.rfind(START)


class Splitter:
    """(reasoning, answer) of one choice's growing text, as positions: the reasoning is
    text[start:end], the answer text[answer:] (None while the thinking is still open, or nothing
    but spaces follows it). Not final, a suffix that may begin </think> is held back. Each call
    reads only what arrived since the last."""

    def __init__(self) -> None:
        # Where the reasoning starts (after <think>, if the text opens with it), once known.
        self._start: int | None = None
        self._scanned = 0
        self._end: int | None = None
        self._answer: int | None = None

    def split(self, text: str, final: bool) -> tuple[tuple[int, int], int | None]:
        if self._start is None:
            self._start = self._opening(text, final)
            if self._start is None:
                return (0, 0), None
            self._scanned = self._start
        if self._end is None:
            found = text.find(END, max(self._start, self._scanned - len(END) + 1))
            self._scanned = len(text)
            if found < 0:
                return (self._start, max(self._start, len(text) - (0 if final else held_back(text, END)))), None
            self._end = self._scanned = found + len(END)
        return (self._start, self._end - len(END)), self._answer_start(text, final)

    def _opening(self, text: str, final: bool) -> int | None:
        """Past <think> if the text opens with it (after spaces), else 0; None while undecided."""
        first = self._scanned
        while first < len(text) and text[first].isspace():
            first += 1
        self._scanned = first
        if text.startswith(START, first):
            return first + len(START)
        if not final and len(text) - first < len(START) and START.startswith(text[first:]):
            return None
        return 0

    def _answer_start(self, text: str, final: bool) -> int | None:
        """The answer's first position, past the spaces after </think>; None until it is known (it
        may start later), unless final."""
        if self._answer is None:
            first = self._scanned
            while first < len(text) and text[first].isspace():
                first += 1
            self._scanned = first
            if first == len(text) and not final:
                return None
            self._answer = first
        return self._answer
