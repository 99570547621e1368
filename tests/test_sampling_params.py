"""SamplingParams: its ranges, and its wire form, which the gateway, scheduler and executor share."""
import math
from dataclasses import fields

import pytest

from pagedserve.common.sampling_params import (INT32_MAX, RANGES, OutOfRange, SamplingParams,
                                               StructuredOutputsParams, sampling_from_proto, sampling_to_proto)
from pagedserve.v1 import sampling_pb2 as pb

WIRE_FIELDS = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields]
# What the gateway applies itself (choices, stop strings, detokenizing, prompt truncation) and so never sends.
GATEWAY_FIELDS = {"n", "stop", "include_stop_str_in_output", "skip_special_tokens", "bad_words",
                  "truncate_prompt_tokens"}
# Every wire field away from its default; the floats are exact in float32, as on the wire.
EVERY_FIELD_SET = SamplingParams(temperature=0.5, top_p=0.75, top_k=4, min_p=0.125, seed=-7, max_tokens=9,
                                 min_tokens=3, stop_token_ids=[2, 9], ignore_eos=True, presence_penalty=0.5,
                                 frequency_penalty=-1.5, repetition_penalty=1.25, logprobs=0,
                                 prompt_logprobs=2, logit_bias={3: 1.5, 7: -100.0}, allowed_token_ids=[4, 8],
                                 bad_words_token_ids=[[5], [6, 7]],
                                 structured_outputs=StructuredOutputsParams(json='{"type": "object"}'))


def through_the_wire(params: SamplingParams) -> SamplingParams:
    return sampling_from_proto(pb.SamplingParams.FromString(sampling_to_proto(params).SerializeToString()))


def wire_values(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in WIRE_FIELDS}


def test_the_message_carries_every_field_but_the_gateways():
    assert {f.name for f in fields(SamplingParams)} - set(WIRE_FIELDS) == GATEWAY_FIELDS
    assert set(WIRE_FIELDS) <= {f.name for f in fields(SamplingParams)}


def test_every_wire_field_survives_the_wire():
    default = SamplingParams()
    assert all(getattr(EVERY_FIELD_SET, name) != getattr(default, name) for name in WIRE_FIELDS)
    assert wire_values(through_the_wire(EVERY_FIELD_SET)) == wire_values(EVERY_FIELD_SET)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(max_tokens=None, seed=None, logprobs=None),
                                    SamplingParams(temperature=0.0, seed=0, max_tokens=INT32_MAX)])
def test_defaults_nones_and_zeros_survive_the_wire(params):
    assert through_the_wire(params) == params


def test_an_empty_message_is_greedy_to_the_end_of_the_context():
    # What a gRPC client that sets nothing gets: proto3 zeros, and SamplingParams' other defaults.
    assert sampling_from_proto(pb.SamplingParams()) == SamplingParams(temperature=0.0, max_tokens=None)


def test_a_message_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        sampling_from_proto(pb.SamplingParams(top_p=0.0))


def outside(name: str) -> list:
    allowed = RANGES[name]
    values = [allowed.low if allowed.low_open else allowed.low - 1]
    return values if allowed.high == math.inf else values + [allowed.high + 1]


@pytest.mark.parametrize("name", RANGES)
def test_every_value_outside_its_range_is_refused_by_name(name):
    for value in outside(name):
        with pytest.raises(OutOfRange) as e:
            SamplingParams(**{name: [value] if name == "stop_token_ids" else value})
        assert e.value.param == name and str(e.value).startswith(f"{name} must be ")
        assert str(e.value).endswith(f", got {value}")


def test_range_messages_read_as_intervals():
    messages = {}
    for name, value in (("top_p", 0), ("temperature", -1), ("repetition_penalty", 0), ("logprobs", -1)):
        with pytest.raises(OutOfRange) as e:
            SamplingParams(**{name: value})
        messages[name] = str(e.value)
    assert messages == {"top_p": "top_p must be in (0, 1], got 0",
                        "temperature": "temperature must be at least 0 (0 = greedy), got -1",
                        "repetition_penalty": "repetition_penalty must be greater than 0 (1 = off), got 0",
                        "logprobs": "logprobs must be in [0, 2147483647], got -1"}


def test_nan_is_out_of_every_range():
    with pytest.raises(OutOfRange):
        SamplingParams(repetition_penalty=float("nan"))


def test_top_k_minus_one_is_off_as_in_vllm():
    assert SamplingParams(top_k=-1).top_k == 0


def test_choice_params_offset_and_wrap_the_seed():
    from pagedserve.common.sampling_params import choice_params

    children = choice_params(SamplingParams(n=3, seed=2**63 - 2, temperature=0.5))
    assert [c.seed for c in children] == [2**63 - 2, 2**63 - 1, -2**63]
    assert all(c.n == 1 and c.temperature == 0.5 for c in children)
    assert [c.seed for c in choice_params(SamplingParams(n=2))] == [None, None]


@pytest.mark.parametrize("structured", [StructuredOutputsParams(regex=r"\d+"), StructuredOutputsParams(choice=["a", "b"]),
                                        StructuredOutputsParams(grammar='start: "x"'),
                                        StructuredOutputsParams(json_object=True)])
def test_every_constraint_kind_survives_the_wire(structured):
    assert through_the_wire(SamplingParams(structured_outputs=structured)).structured_outputs == structured


def test_a_schema_given_as_a_dict_travels_as_its_text():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    assert through_the_wire(params).structured_outputs.json == '{"type": "object"}'


@pytest.mark.parametrize("kinds", [{}, {"regex": "a", "choice": ["a"]}, {"json_object": False}])
def test_a_constraint_takes_exactly_one_kind(kinds):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(**kinds)


def test_logit_bias_is_clamped_and_its_ids_checked():
    assert SamplingParams(logit_bias={5: 250, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}
    with pytest.raises(OutOfRange):
        SamplingParams(logit_bias={-1: 1.0})
