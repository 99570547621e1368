"""MessageWire: the neutral events as Anthropic's stream events and whole message, which agree."""
import json

import msgspec

from pagedserve.gateway.anthropic_output import MessageWire, stop
from pagedserve.gateway.output_events import (Collected, Finish, Outcome, ReasoningDelta, Step, TextDelta,
                                              ToolCallDelta)
from pagedserve.gateway.schemas import FunctionCall, ToolCall, Usage

USAGE = Usage(7, 5, 12)
# Each delta type: the block key it extends, and its own field that holds the text.
DELTAS = {"text_delta": ("text", "text"), "thinking_delta": ("thinking", "thinking"),
          "input_json_delta": ("partial", "partial_json")}


def streamed(events: list) -> list[dict]:
    wire = MessageWire("msg_1", "m", lambda: USAGE)
    out = wire.openings() + wire.step(Step(0, events)) + wire.closing(USAGE)
    return [msgspec.to_builtins(e) for e in out]


def blocks(stream: list[dict]) -> list[dict]:
    """The content blocks a client accumulates from the stream events."""
    built = []
    for e in stream:
        if e["type"] == "content_block_start":
            assert e["index"] == len(built)
            built.append(dict(e["content_block"], partial=""))
        elif e["type"] == "content_block_delta":
            delta = e["delta"]
            key, field = DELTAS[delta["type"]]
            built[e["index"]][key] += delta[field]
    for block in built:
        partial = block.pop("partial")
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial)
    return built


def whole(outcome: Outcome) -> dict:
    return msgspec.to_builtins(MessageWire("msg_1", "m", lambda: USAGE).body(Collected([outcome], USAGE)))


def outcome(content, reasoning, calls, finish) -> Outcome:
    return Outcome(0, "", content, reasoning, calls, finish, [], None)


def test_thinking_text_and_tool_calls_stream_as_the_whole_message_holds_them():
    events = [ReasoningDelta("Think"), ReasoningDelta("ing."), TextDelta("Let me "), TextDelta("look."),
              ToolCallDelta(0, "call_1", "f", ""), ToolCallDelta(0, None, None, '{"a": '),
              ToolCallDelta(0, None, None, "1}"), ToolCallDelta(1, "call_2", "g", "{}"), Finish("tool_calls")]
    stream = streamed(events)
    assert [e["type"] for e in stream[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in stream[-2:]] == ["message_delta", "message_stop"]
    assert stream[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert stream[-2]["usage"] == {"output_tokens": 5, "input_tokens": 7}
    starts = [e["index"] for e in stream if e["type"] == "content_block_start"]
    stops = [e["index"] for e in stream if e["type"] == "content_block_stop"]
    assert starts == stops == [0, 1, 2, 3]
    calls = [ToolCall("call_1", FunctionCall("f", '{"a": 1}')), ToolCall("call_2", FunctionCall("g", "{}"))]
    message = whole(outcome("Let me look.", "Thinking.", calls, Finish("tool_calls")))
    assert blocks(stream) == message["content"] == [
        {"type": "thinking", "thinking": "Thinking.", "signature": ""}, {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
        {"type": "tool_use", "id": "call_2", "name": "g", "input": {}}]
    assert message["stop_reason"] == "tool_use" and message["usage"] == {"input_tokens": 7, "output_tokens": 5}


def test_spaces_before_a_tool_call_are_dropped_as_the_whole_message_drops_them():
    events = [TextDelta("\n"), ToolCallDelta(0, "call_1", "f", "{}"), Finish("tool_calls")]
    assert [b["type"] for b in blocks(streamed(events))] == ["tool_use"]
    assert [b["type"] for b in blocks(streamed([TextDelta("\n"), TextDelta("Hi"), Finish("stop")]))] == ["text"]
    assert blocks(streamed([TextDelta("\n"), TextDelta("Hi"), Finish("stop")]))[0]["text"] == "\nHi"


def test_an_empty_output_is_one_empty_text_block_both_ways():
    assert blocks(streamed([Finish("length")])) == whole(outcome(None, None, [], Finish("length")))["content"] == [
        {"type": "text", "text": ""}]


def test_stop_reasons():
    assert stop(Finish("length"), True) == ("max_tokens", None)
    assert stop(Finish("stop", "END"), False) == ("stop_sequence", "END")
    assert stop(Finish("stop", 7), False) == ("end_turn", None)
    # A named tool_choice finishes with "stop" in chat's terms; Anthropic says tool_use.
    assert stop(Finish("stop"), True) == ("tool_use", None)
