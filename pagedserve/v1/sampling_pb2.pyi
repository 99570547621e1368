from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "structured_outputs", "logit_bias", "prompt_logprobs", "allowed_token_ids", "bad_words_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    structured_outputs: StructuredOutputs
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object", "reasoning_end_ids")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REASONING_END_IDS_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    json_object: bool
    reasoning_end_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., reasoning_end_ids: _Optional[_Iterable[int]] = ...) -> None: ...
