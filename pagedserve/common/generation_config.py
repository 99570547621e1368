"""A model's default sampling options from its generation_config.json, as vLLM's
`--generation-config` reads them: `auto` (the model's folder), `vllm` (none), or another folder;
`--override-generation-config` sets some over them."""
import json
from pathlib import Path

from pagedserve.common.sampling_params import SamplingParams

# generation_config.json's names of the options a request may omit. SamplingParams shares them but
# for transformers' max_new_tokens, its max_tokens.
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
_RENAMED = {"max_new_tokens": "max_tokens"}


def sampling_defaults(model: str | Path, source: str = "auto", override: dict | None = None) -> dict:
    """The sampling options the model's generation config sets, with `override`'s (vLLM's
    --override-generation-config) over them, by SamplingParams' names; a request's own values win
    (max_tokens within max_tokens_cap). Raises ValueError for an option out of range or one
    `override` may not set."""
    unknown = sorted(set(override or {}) - set(FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config sets {unknown[0]!r}; it sets {', '.join(FIELDS)}")
    defaults = _renamed(_from_file(model, source))
    _check(defaults, "generation_config.json")
    merged = {**defaults, **_renamed(override or {})}
    _check(merged, "--override-generation-config")
    return merged


def max_tokens_cap(defaults: dict, source: str = "auto", override: dict | None = None) -> int | None:
    """The most max_tokens any request gets, as vLLM sets it: --override-generation-config's
    max_new_tokens, or that of a --generation-config folder (in `defaults`, sampling_defaults')."""
    if source in ("auto", "vllm"):
        return (override or {}).get("max_new_tokens")
    return defaults.get("max_tokens")


def _renamed(options: dict) -> dict:
    return {_RENAMED.get(name, name): value for name, value in options.items()}


def _check(defaults: dict, where: str) -> None:
    """A value out of range fails at start, not on every request."""
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _from_file(model: str | Path, source: str) -> dict:
    if source == "vllm":
        return {}
    folder = Path(model if source == "auto" else source)
    path = (folder.parent if folder.is_file() else folder) / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise FileNotFoundError(f"--generation-config {source}: {path} not found; pass a folder "
                                    "holding generation_config.json, or auto, or vllm")
        return {}
    config = json.loads(path.read_text())
    return {name: config[name] for name in FIELDS if config.get(name) is not None}
