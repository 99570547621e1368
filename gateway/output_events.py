"""The one output path: a plan's engine stream read into protocol-neutral events (text, reasoning,
tool-call fragments, finish, usage), which each protocol writes in its own wire form.

steps() groups the events of one engine output of one choice (what chat and completions send as
one chunk); events() is the same stream flat, then the usage. collect() is the whole output, for
a response that is not streamed: the same reading of the same text, so the fragments a stream
sends add up to it."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.gateway.logprobs import TokenLogprob
from pagedserve.gateway.schemas import ToolCall, Usage

if TYPE_CHECKING:
    from pagedserve.gateway.request_plan import Plan


@dataclass(slots=True)
class TextDelta:
    text: str
    choice: int = 0


@dataclass(slots=True)
class ReasoningDelta:
    text: str
    choice: int = 0


@dataclass(slots=True)
class ToolCallDelta:
    """A fragment of tool call `index`: its id and name on its first fragment only, None after."""
    index: int
    id: str | None
    name: str | None
    arguments_fragment: str
    choice: int = 0


@dataclass(slots=True)
class Finish:
    """How a choice ended: "stop", "length" or (tools found, where the plan says so) "tool_calls";
    stop_reason names the stop string or stop token id that ended it (None for EOS)."""
    reason: str
    stop_reason: str | int | None = None
    choice: int = 0


@dataclass(slots=True)
class UsageEvent:
    usage: Usage


Event = TextDelta | ReasoningDelta | ToolCallDelta | Finish | UsageEvent


@dataclass(slots=True)
class Step:
    """What one engine output added to one choice: its events in order (a Finish last, when it
    ended), the logprobs and ids of its tokens, and (on a choice's first step) its prompt logprobs."""
    choice: int
    events: list[Event]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Outcome:
    """One choice's whole output: the text as generated, then read as a message."""
    choice: int
    text: str
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish: Finish
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob] | None
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Collected:
    outcomes: list[Outcome]
    usage: Usage


async def steps(plan: Plan) -> AsyncIterator[Step]:
    """Each choice's output as it arrives; closing it aborts the engine requests still running."""
    async with aclosing(plan.generation.events()) as generated:
        async for event in generated:
            reader = plan.outputs[event.index]
            final = event.finish_reason is not None
            events = reader.read(event.text, final, event.index)
            if final:
                events.append(Finish(reader.finish_reason(event.finish_reason), event.stop_reason, event.index))
            yield Step(event.index, events, event.logprobs, event.prompt_logprobs, event.token_ids)


async def events(plan: Plan) -> AsyncIterator[Event]:
    """The events of every step in order, then the usage once every choice has finished."""
    async with aclosing(steps(plan)) as stepped:
        async for step in stepped:
            for event in step.events:
                yield event
    yield UsageEvent(plan.generation.usage())


async def collect(plan: Plan) -> Collected:
    """Every choice's whole output (ordered by choice) and the usage."""
    texts: list[list[str]] = [[] for _ in plan.choices]
    logprobs: list[list[TokenLogprob]] = [[] for _ in plan.choices]
    token_ids: list[list[int]] = [[] for _ in plan.choices]
    prompts: list[list[TokenLogprob] | None] = [None] * len(plan.choices)
    finals = []
    async with aclosing(plan.generation.events()) as generated:
        async for event in generated:
            texts[event.index].append(event.text)
            logprobs[event.index] += event.logprobs
            token_ids[event.index] += event.token_ids
            if event.prompt_logprobs is not None:
                prompts[event.index] = event.prompt_logprobs
            if event.finish_reason is not None:
                finals.append(event)
    outcomes = []
    for final in sorted(finals, key=lambda e: e.index):
        i, text = final.index, "".join(texts[final.index])
        reader = plan.outputs[i]
        message = reader.message(text)
        finish = Finish(reader.finish_reason(final.finish_reason), final.stop_reason, i)
        outcomes.append(Outcome(i, text, message.content, message.reasoning, message.tool_calls, finish,
                                logprobs[i], prompts[i], token_ids[i]))
    return Collected(outcomes, plan.generation.usage())
