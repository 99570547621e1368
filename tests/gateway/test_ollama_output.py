"""Replies: the neutral events as Ollama's reply lines and whole reply, which agree."""
import msgspec

from pagedserve.gateway.ollama_output import Clock, Replies
from pagedserve.gateway.output_events import (Collected, Finish, Outcome, ReasoningDelta, Step, TextDelta,
                                              ToolCallDelta)
from pagedserve.gateway.schemas import FunctionCall, ToolCall, Usage

USAGE = Usage(7, 5, 12)


def streamed(events: list, chat: bool = True) -> list[dict]:
    replies = Replies("1", "m", chat, Clock())
    return [msgspec.to_builtins(line) for line in replies.step(Step(0, events)) + replies.closing(USAGE)]


def test_calls_go_out_whole_when_the_next_begins_and_at_the_end():
    events = [ReasoningDelta("Hm."), ToolCallDelta(0, "c1", "f", '{"a": '), ToolCallDelta(0, None, None, "1}"),
              ToolCallDelta(1, "c2", "g", "{}"), Finish("tool_calls")]
    lines = streamed(events)
    assert [line["message"].get("tool_calls") for line in lines[1:3]] == [
        [{"function": {"name": "f", "arguments": {"a": 1}}}], [{"function": {"name": "g", "arguments": {}}}]]
    assert lines[0]["message"] == {"role": "assistant", "content": "", "thinking": "Hm."}
    last = lines[-1]
    assert last["done"] and last["done_reason"] == "stop" and not any(line["done"] for line in lines[:-1])
    assert (last["prompt_eval_count"], last["eval_count"], last["load_duration"]) == (7, 5, 0)
    assert last["total_duration"] == last["prompt_eval_duration"] + last["eval_duration"]
    replies = Replies("1", "m", True, Clock())
    calls = [ToolCall("c1", FunctionCall("f", '{"a": 1}')), ToolCall("c2", FunctionCall("g", "{}"))]
    whole = msgspec.to_builtins(replies.body(Collected([Outcome(0, "", None, "Hm.", calls, Finish("tool_calls"),
                                                                [], None)], USAGE)))
    assert whole["message"]["tool_calls"] == [c for line in lines for c in line["message"].get("tool_calls", [])]
    assert whole["message"]["content"] == "" and whole["done_reason"] == "stop"


def test_spaces_before_a_call_are_dropped_and_kept_before_text():
    lines = streamed([TextDelta("\n"), ToolCallDelta(0, "c1", "f", "{}"), Finish("tool_calls")])
    assert "".join(line["message"]["content"] for line in lines) == ""
    lines = streamed([TextDelta("\n"), TextDelta("Hi"), Finish("length")])
    assert "".join(line["message"]["content"] for line in lines) == "\nHi" and lines[-1]["done_reason"] == "length"


def test_generate_lines_carry_response_and_thinking():
    lines = streamed([ReasoningDelta("Hm."), TextDelta("Yes."), Finish("stop")], chat=False)
    assert [(line.get("thinking"), line["response"]) for line in lines] == [("Hm.", ""), (None, "Yes."), (None, "")]
