"""--reasoning-parser: the thinking of a reasoning model (<think>…</think>) apart from its answer.

deepseek_r1: everything before </think> is reasoning, with or without <think> (newer templates
put <think> in the prompt). qwen3: the same; with enable_thinking off the template closes the
thinking in the prompt itself, and a prompt whose last think tag is </think> makes the whole
output the answer (vLLM detects it the same way, from the prompt). mistral (Magistral): [THINK]…
[/THINK], special tokens the text keeps for it; an output that does not open with [THINK] is all
answer, as vLLM's parser reads it. Like the tool parsers, a split of a longer text extends the
previous split's parts, so a stream sends their new suffixes."""
from dataclasses import dataclass

from pagedserve.gateway.call_scan import held_back


@dataclass(frozen=True, slots=True)
class Format:
    """A reasoning model's think tags; `opens`: thinking is there only where the output opens with
    `start` (else the prompt may have opened it)."""
    start: str
    end: str
    opens: bool = False


FORMATS = {"deepseek_r1": Format("<think>", "</think>"), "qwen3": Format("<think>", "</think>"),
           "mistral": Format("[THINK]", "[/THINK]", opens=True)}
PARSERS = tuple(FORMATS)
# Where a Splitter's reasoning starts when the output has none (a `Format.opens` output without its tag).
_NO_THINKING = -1
# Parsers whose tags are special tokens, which the text must keep to be read.
KEEP_SPECIAL_TOKENS = frozenset({"mistral"})


def ended_in_prompt(prompt: str, tags: Format) -> bool:
    """Whether the prompt itself closes the thinking (its last think tag is the end tag)."""
    return prompt.rfind(tags.end) > prompt.rfind(tags.start)


class Splitter:
    """(reasoning, answer) of one choice's growing text, as positions: the reasoning is
    text[start:end], the answer text[answer:] (None while the thinking is still open, or nothing
    but spaces follows it). Not final, a suffix that may begin </think> is held back. Each call
    reads only what arrived since the last."""

    def __init__(self, tags: Format) -> None:
        self._tags = tags
        # Where the reasoning starts (after the start tag, if the text opens with it), once known.
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
        if self._start == _NO_THINKING:
            return (0, 0), 0
        end = self._tags.end
        if self._end is None:
            found = text.find(end, max(self._start, self._scanned - len(end) + 1))
            self._scanned = len(text)
            if found < 0:
                return (self._start, max(self._start, len(text) - (0 if final else held_back(text, end)))), None
            self._end = self._scanned = found + len(end)
        return (self._start, self._end - len(end)), self._answer_start(text, final)

    def _opening(self, text: str, final: bool) -> int | None:
        """Past the start tag if the text opens with it (after spaces), else 0 (_NO_THINKING where
        the format needs the tag); None while undecided."""
        first = self._scanned
        while first < len(text) and text[first].isspace():
            first += 1
        self._scanned = first
        start = self._tags.start
        if text.startswith(start, first):
            return first + len(start)
        if not final and len(text) - first < len(start) and start.startswith(text[first:]):
            return None
        return _NO_THINKING if self._tags.opens else 0

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
