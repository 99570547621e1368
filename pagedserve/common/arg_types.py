"""Flag value types with vLLM's value forms (`8k`, `1M`, `half`), range-checked when parsed.

Each type takes the flag's text or, for the offline LLM's keyword arguments, a Python value, and
raises argparse.ArgumentTypeError with a one-line reason; argparse prefixes the flag's name."""
import argparse
import json
import re
from collections.abc import Callable

# vLLM's human_readable_int: lowercase suffixes are decimal, uppercase binary.
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "fp32": "float32"}


def positive_int(value: str | int) -> int:
    number = _integer(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return number


def non_negative_int(value: str | int) -> int:
    number = _integer(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value!r}")
    return number


def name(value: str) -> str:
    """Non-empty text with no white space at its ends (a role, a name)."""
    if not value or value != value.strip():
        raise argparse.ArgumentTypeError(f"must be a name without surrounding white space, got {value!r}")
    return value


def max_logprobs(value: str | int) -> int:
    """0 or more, or -1 for the whole vocabulary, as vLLM's --max-logprobs takes."""
    number = _integer(value)
    if number < -1:
        raise argparse.ArgumentTypeError(f"must be 0 or more, or -1 for the whole vocabulary, got {value!r}")
    return number


def size(value: str | int) -> int:
    """A positive integer, also as vLLM writes sizes: 8k = 8000, 8K = 8192, 1.5m = 1500000."""
    if isinstance(value, str):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value.strip())
        if match:
            number, suffix = match.groups()
            if suffix.isupper() and "." in number:
                raise argparse.ArgumentTypeError(
                    f"decimals do not go with binary suffixes like {suffix}: write {number}{suffix.lower()}")
            value = int(float(number) * _SUFFIXES[suffix])
    return positive_int(value)


def fraction(value: str | float) -> float:
    """A share in (0, 1], as --gpu-memory-utilization takes."""
    try:
        share = float(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {value!r}") from None
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value!r}: it is a share of the "
                                         "GPU's memory, 0.9 = 90%")
    return share


def non_negative_float(value: str | float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a number, 0 or more, got {value!r}") from None
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value!r}")
    return number


def port(value: str | int) -> int:
    number = _integer(value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535, got {value!r}")
    return number


def dtype(value: str) -> str:
    """vLLM's dtype names and aliases (half, float, ...) to torch's names; checked by `choices`."""
    return DTYPE_ALIASES.get(value, value)


def kv_cache_dtype(value: str) -> str:
    """vLLM's KV-cache dtype names: fp8 and fp8_e4m3 are one format; fp8_e5m2 is not built."""
    name = str(value).lower()
    if name == "fp8_e5m2":
        raise argparse.ArgumentTypeError("fp8_e5m2 KV caches are not built; use fp8 (e4m3) or auto")
    return "fp8" if name == "fp8_e4m3" else name


def only(supported: object, feature: str, what_runs: str) -> Callable[[object], object]:
    """A flag whose one supported value is `supported` until `feature` is built; others fail."""
    def check(value: object) -> object:
        if str(value).lower() != str(supported).lower():
            raise argparse.ArgumentTypeError(f"{feature} is not built yet ({what_runs}); drop {value!r}")
        return supported
    return check


def json_object(value: str | dict) -> dict:
    """A JSON object, as --pooler-config and --hf-overrides take (a dict from the offline LLM)."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"normalize\": false}}', "
                                         f"got {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {value!r}")
    return parsed


def _integer(value: str | int) -> int:
    if isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}")
    try:
        return int(value) if isinstance(value, str) else _exact_int(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None


def _exact_int(value: object) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    return int(value)
