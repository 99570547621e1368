"""Per-request generation options, with vLLM's names and defaults; the range each may take; and
their wire form (pagedserve.v1.SamplingParams), which the scheduler and the executor share."""
import copy
import json
import math
from dataclasses import dataclass, field

from pagedserve.v1 import sampling_pb2 as pb

# vLLM's default --max-logprobs: the most top logprobs a request may ask for per token.
MAX_LOGPROBS = 20
# The wire's integer fields are int32, the seed an int64.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


@dataclass(frozen=True, slots=True)
class Range:
    """The values a number may take: low to high, high included, low too unless open."""
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    # What a special value means, for the error message ("0 = off").
    note: str = ""
    # The least value in range: with it the check is one chained comparison (SamplingParams is
    # checked once per request on each side of the wire), and NaN, which compares false, is out.
    least: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "least", math.nextafter(self.low, math.inf) if self.low_open else self.low)

    def __str__(self) -> str:
        if self.high == math.inf:
            text = f"greater than {_number(self.low)}" if self.low_open else f"at least {_number(self.low)}"
        else:
            text = f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}]"
        return f"{text} ({self.note})" if self.note else text


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class OutOfRange(ValueError):
    """A parameter outside its range; `param` names it."""

    def __init__(self, param: str, allowed: Range, value: float) -> None:
        super().__init__(f"{param} must be {allowed}, got {value}")
        self.param = param


# Every range a sampling parameter is checked against, by SamplingParams and by the gateway (whose
# OpenAI API allows less on a few fields: gateway/schemas.py). The integer bounds are the wire's,
# so that every SamplingParams fits the message. A list's range is each of its values'.
RANGES: dict[str, Range] = {
    "n": Range(1),
    "temperature": Range(0, note="0 = greedy"),
    "top_p": Range(0, 1, low_open=True),
    # vLLM takes -1 for off as well.
    "top_k": Range(-1, INT32_MAX, note="0 or -1 = off"),
    "min_p": Range(0, 1),
    "seed": Range(INT64_MIN, INT64_MAX),
    "max_tokens": Range(1, INT32_MAX),
    "min_tokens": Range(0, INT32_MAX),
    "stop_token_ids": Range(0, INT32_MAX),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, low_open=True, note="1 = off"),
    # The engine's --max-logprobs bounds both further (check_logprobs).
    "logprobs": Range(0, INT32_MAX),
    "prompt_logprobs": Range(0, INT32_MAX),
}

# OpenAI's bound on a logit_bias value; a larger one is clamped to it, as OpenAI does.
MAX_LOGIT_BIAS = 100.0

# Bounds on what one request carries, checked where requests enter the engine (Scheduler.add, for
# the gateway and direct Engine API callers alike), so that converting and applying them stays
# small per request and per step; the gateway refuses the same with a 400. A list of a few hundred
# words to ban or favour fits the logit_bias bound, at which the scheduler's part (decode, check,
# plan encoding) and the executor's decode take about a millisecond per request together
# (tests/scheduler_svc/test_request_checks.py bounds it), and the gateway fans 64 prompts x n=16 at
# the bound out in about 2 ms. vLLM sets none; a 4 MiB body holds 150k entries.
MAX_LOGIT_BIAS_TOKENS = 1024
# bad_words' token ids in all: a few hundred words, which the executor compares with a row's last
# outputs each step.
MAX_BAD_WORDS_TOKENS = 4096
# A model has a handful of end-of-turn tokens; the executor uploads a request's stop ids every step
# while it masks them for min_tokens.
MAX_STOP_TOKEN_IDS = 1024
# A reasoning model's </think> is a token or a few; the executor compares them with its outputs.
MAX_REASONING_END_IDS = 32
# A structured output's schema, regex, grammar or choices, in characters (vLLM sets no limit):
# validating one is superlinear: a 62 KB JSON schema took 0.26 s, a 250 KB one 3.7 s, a 64 KiB
# regex 0.05 s.
MAX_CONSTRAINT_CHARS = 64 * 1024
# A request's cache_salt (a tenant's name or a random string) is hashed with its first KV block.
MAX_CACHE_SALT_CHARS = 256


def check_ranges(params: object, ranges: dict[str, Range]) -> None:
    """Raises OutOfRange for the first attribute of `params` named in `ranges` that is outside it
    (None is always allowed; a list is checked value by value)."""
    for name, allowed in ranges.items():
        value = getattr(params, name)
        if isinstance(value, list):
            value = next((v for v in value if not allowed.least <= v <= allowed.high), None)
        if value is not None and not allowed.least <= value <= allowed.high:
            raise OutOfRange(name, allowed, value)


# The kinds of StructuredOutputsParams, in the order its fields are listed.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's StructuredOutputsParams), exactly one kind set: a JSON
    schema (a dict or its text), a regex, one of a list of strings, a Lark or GBNF grammar, or
    any JSON object."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # The tokens that end a reasoning model's thinking (its </think>): the constraint applies to
    # what follows them, the thinking stays free. None: from the first token.
    reasoning_end_ids: list[int] | None = None

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar or "
                             f"json_object; got {', '.join(kinds) or 'none'}")

    def kinds(self) -> list[str]:
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def schema_text(self) -> str | None:
        """The JSON schema as text (None unless the kind is json)."""
        return self.json if self.json is None or isinstance(self.json, str) else json.dumps(self.json)


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams for LLM.beam_search. Each round ranks by the model's raw logprobs, so
    temperature changes no result (accepted as vLLM accepts it)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # The number of top logprobs to return per output token (0: the sampled token's only); None: none.
    logprobs: int | None = None
    # The number of top logprobs to return per prompt token (0: the prompt token's only); None: none.
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Token id -> what to add to its logit, clamped to [-100, 100].
    logit_bias: dict[int, float] | None = None
    # vLLM's: the only tokens the output may hold (None: any).
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output may not hold, as text (tokenized where the tokenizer is, the gateway or
    # the offline LLM, into bad_words_token_ids; common/bad_words.py).
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's: the model reads only the prompt's last this many tokens (-1: the model's limit); the
    # offline LLM cuts them (the gateway cuts a request's before it sends it).
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check_ranges(self, RANGES)
        self.top_k = max(self.top_k, 0)
        if self.logit_bias:
            self.logit_bias = _clamped_bias(self.logit_bias)


def _clamped_bias(bias: dict[int, float]) -> dict[int, float]:
    bad = next((t for t in bias if not 0 <= int(t) <= INT32_MAX), None)
    if bad is not None:
        raise OutOfRange("logit_bias", Range(0, INT32_MAX, note="token ids"), bad)
    return {int(t): max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(b))) for t, b in bias.items()}


def prompt_keep(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens the model reads under truncate_prompt_tokens (None: all);
    raises OutOfRange for a value other than -1 (the model's limit) or 1 to max_model_len."""
    if truncate_prompt_tokens is None:
        return None
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if not 1 <= keep <= max_model_len:
        raise OutOfRange("truncate_prompt_tokens", Range(1, max_model_len, note="or -1: the model's limit"),
                         truncate_prompt_tokens)
    return keep


def check_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """Raises OutOfRange if logprobs or prompt_logprobs asks for more than the engine's
    --max-logprobs, which sized the executor's buffers."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise OutOfRange(name, Range(0, max_logprobs, note="the server's --max-logprobs"), value)


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                  max_logprobs: int) -> None:
    """Raises ValueError (OutOfRange for an id) naming the first field that holds a token id outside
    [0, vocab_size) or is longer than its bound: the prompt, stop_token_ids, logit_bias keys, bad
    words, allowed_token_ids (and an empty one) and reasoning_end_ids, and the constraint's size; or
    logprobs past `max_logprobs`. An id past the vocabulary would index past the embedding or, in the
    executor's flat [rows x vocab] logits, into another request's row."""
    check_logprobs(params, max_logprobs)
    _check_ids("prompt_token_ids", prompt_token_ids, vocab_size)
    _check_ids("stop_token_ids", params.stop_token_ids, vocab_size, MAX_STOP_TOKEN_IDS)
    if params.logit_bias:
        _check_ids("logit_bias", list(params.logit_bias), vocab_size, MAX_LOGIT_BIAS_TOKENS)
    if params.bad_words_token_ids:
        _check_ids("bad_words", [t for word in params.bad_words_token_ids for t in word], vocab_size,
                   MAX_BAD_WORDS_TOKENS)
    if params.allowed_token_ids is not None:
        if not params.allowed_token_ids:
            raise ValueError("allowed_token_ids is empty, which allows no token; name at least one or leave it out")
        _check_ids("allowed_token_ids", params.allowed_token_ids, vocab_size)
    structured = params.structured_outputs
    if structured is not None:
        _check_ids("reasoning_end_ids", structured.reasoning_end_ids or [], vocab_size, MAX_REASONING_END_IDS)
        size = sum(len(text) for text in (structured.schema_text(), structured.regex, structured.grammar,
                                           *(structured.choice or ())) if text)
        if size > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs holds {size} characters; at most {MAX_CONSTRAINT_CHARS} "
                             "are allowed, so simplify the schema, regex, grammar or choices")


def _check_ids(name: str, ids: list[int], vocab_size: int, limit: int | None = None) -> None:
    if limit is not None and len(ids) > limit:
        raise ValueError(f"{name} holds {len(ids)} token ids; at most {limit} are allowed")
    # min and max run in C: about 0.1 ms for an 8k-token prompt.
    if ids and not (min(ids) >= 0 and max(ids) < vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise OutOfRange(name, Range(0, vocab_size - 1, note="token ids of this model"), bad)


def choice_params(params: SamplingParams) -> list[SamplingParams]:
    """The n single-choice requests of `params`, seeds offset by the choice (so that samples differ)
    and wrapped into the int64 the wire carries. They share params' lists and maps: copies, not new
    SamplingParams, so that a large logit_bias is not checked and clamped again for each."""
    def child(i: int) -> SamplingParams:
        copied = copy.copy(params)
        copied.n = 1
        copied.seed = None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63
        return copied
    return [child(i) for i in range(params.n)]


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    """The wire form; n, stop strings and the detokenizing options stay with the gateway."""
    return pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=p.seed,
        max_tokens=p.max_tokens, min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
        logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs, logit_bias=p.logit_bias,
        allowed_token_ids=p.allowed_token_ids,
        bad_words_token_ids=[pb.TokenIds(ids=word) for word in p.bad_words_token_ids or ()],
        structured_outputs=None if p.structured_outputs is None else _structured_to_proto(p.structured_outputs))


def _structured_to_proto(s: StructuredOutputsParams) -> pb.StructuredOutputs:
    return pb.StructuredOutputs(json=s.schema_text(), regex=s.regex, choice=s.choice, grammar=s.grammar,
                                json_object=s.json_object, reasoning_end_ids=s.reasoning_end_ids)


def _structured_from_proto(m: pb.StructuredOutputs) -> StructuredOutputsParams:
    present = {k: getattr(m, k) for k in ("json", "regex", "grammar") if m.HasField(k)}
    return StructuredOutputsParams(choice=m.choice[:] or None, json_object=m.json_object,
                                   reasoning_end_ids=m.reasoning_end_ids[:] or None, **present)


# The message's optional fields that, absent, take SamplingParams' default; absent max_tokens is None.
_DEFAULTED = ("top_p", "seed", "repetition_penalty", "logprobs", "prompt_logprobs")


def sampling_from_proto(m: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError for values out of range."""
    present = {name: getattr(m, name) for name in _DEFAULTED if m.HasField(name)}
    return SamplingParams(
        temperature=m.temperature, top_k=m.top_k, min_p=m.min_p,
        max_tokens=m.max_tokens if m.HasField("max_tokens") else None, min_tokens=m.min_tokens,
        stop_token_ids=m.stop_token_ids[:], ignore_eos=m.ignore_eos,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        logit_bias=dict(m.logit_bias) or None, allowed_token_ids=m.allowed_token_ids[:] or None,
        bad_words_token_ids=[word.ids[:] for word in m.bad_words_token_ids if word.ids] or None,
        structured_outputs=(_structured_from_proto(m.structured_outputs)
                            if m.HasField("structured_outputs") else None), **present)
