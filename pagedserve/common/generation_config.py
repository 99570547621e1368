"""A model's default sampling options from its generation_config.json, as vLLM's
`--generation-config` reads them: `auto` (the model's folder), `vllm` (none), or another folder."""
import json
from pathlib import Path

from pagedserve.common.sampling_params import SamplingParams

# generation_config.json's names, which SamplingParams shares, of the options a request may omit.
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model: str | Path, source: str = "auto") -> dict:
    """The sampling options the model's generation config sets; a request's own values win."""
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
    defaults = {name: config[name] for name in FIELDS if config.get(name) is not None}
    SamplingParams(**defaults)  # a value out of range fails at start, not on every request
    return defaults
