"""Beam search as vLLM ranks it, one round at a time: the online `use_beam_search`
(gateway/beam_search.py) and the offline `LLM.beam_search` drive these rounds with their engines.

Each round extends every live beam by its next token's most likely candidates; a candidate that is
the end of text completes a beam (unless ignore_eos), the others compete and the `width` likeliest
live on. At the end the completed and live beams rank by summed logprob over their length (prompt
included, end of text not) to the power length_penalty."""
import heapq
from dataclasses import dataclass, field


@dataclass(slots=True)
class Beam:
    """A continuation: every token (prompt first), its summed logprob, and per output token the
    record its driver keeps (the gateway's TokenLogprob, the offline LLM's logprob dict)."""
    tokens: list[int]
    logprob: float = 0.0
    logprobs: list = field(default_factory=list)
    finish_reason: str = "length"


@dataclass(frozen=True, slots=True)
class Search:
    """What one search keeps: `width` beams, for up to `max_tokens` rounds."""
    width: int
    max_tokens: int
    eos: int | None
    ignore_eos: bool = False
    length_penalty: float = 1.0
    allowed: frozenset[int] | None = None


# A beam's next-token candidates, most likely first: (token id, logprob, the record its beam keeps).
Candidates = list[tuple[int, float, object]]


def score(beam: Beam, eos: int | None, length_penalty: float) -> float:
    """vLLM's ranking: summed logprob over the length (without a final end of text) ** length_penalty."""
    length = len(beam.tokens) - (beam.tokens[-1] == eos)
    return beam.logprob / length ** length_penalty


def grow(live: list[Beam], candidates: list[Candidates], rule: Search, done: list[Beam]) -> list[Beam]:
    """One round: each live beam extended by its candidates (those rule.allowed allows); the ones that
    end the text join `done`, the rule.width likeliest others are returned."""
    grown = []
    for beam, options in zip(live, candidates):
        for token, logprob, record in options:
            if rule.allowed is not None and token not in rule.allowed:
                continue
            child = Beam(beam.tokens + [token], beam.logprob + logprob, beam.logprobs + [record])
            if token == rule.eos and not rule.ignore_eos:
                child.finish_reason = "stop"
                done.append(child)
            else:
                grown.append(child)
    return heapq.nlargest(rule.width, grown, key=lambda b: b.logprob)


def best(live: list[Beam], done: list[Beam], rule: Search) -> list[Beam]:
    """The rule.width best of the completed and the live beams, best first."""
    ranked = sorted(done + live, key=lambda b: score(b, rule.eos, rule.length_penalty), reverse=True)
    return ranked[:rule.width]


def output_tokens(beam: Beam, prompt_length: int, include_stop: bool) -> list[int]:
    """The output tokens a beam shows as text: a final end of text left out unless include_stop."""
    out = beam.tokens[prompt_length:]
    return out[:-1] if beam.finish_reason == "stop" and not include_stop else out
