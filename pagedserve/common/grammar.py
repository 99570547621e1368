"""Structured outputs on llguidance, the one module that knows the grammar library: a request's
constraint as a grammar, its check, compilation with a cache, and the matcher that fills a row of
the packed token bitmask (int32 [rows, ceil(vocab / 32)], bit set = allowed) that every grammar
backend writes, so the sampler's mask code would not change with the library.

llguidance rather than xgrammar: no dependencies (xgrammar imports transformers at import time and
pins torch), its tokenizer builds straight from the `tokenizers` JSON that pagedserve already
loads, and compilation is lazy, so a new schema costs about a millisecond."""
import json
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np

from pagedserve.common.sampling_params import StructuredOutputsParams
from pagedserve.common.tokenizer import Tokenizer

# Compact JSON: a small model given free whitespace can pad an object with newlines until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False}
# Compiled grammars kept for reuse (fresh matchers, copied for each request).
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A constraint the grammar library cannot honour; the message says why."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint."""
    kind = params.kind
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(params.schema_text(), defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not a JSON object: {e}") from e
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise GrammarError(str(e)) from e


def check(params: StructuredOutputsParams) -> None:
    """Raises GrammarError for a constraint that cannot compile (a bad regex, an unsupported
    JSON schema feature, a grammar that does not parse)."""
    if params.choice is not None and not all(params.choice):
        raise GrammarError("every choice must be a non-empty string")
    error = llguidance.LLMatcher.validate_grammar(grammar_text(params))
    if error:
        raise GrammarError(error.strip().splitlines()[0])


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row] (int32, C-contiguous). Once the
        output is complete, or after a token the grammar refused, only EOS is allowed."""
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def accept(self, token_id: int) -> None:
        # A refused token (one sampled past the end, which the scheduler drops) leaves the matcher
        # in its error state, which allows EOS only.
        self._matcher.consume_token(token_id)


class GrammarCompiler:
    """Compiles constraints for one tokenizer on worker threads (llguidance releases the GIL),
    keeping the latest CACHE_SIZE grammars; each request gets its own copy of the matcher."""

    def __init__(self, load_tokenizer: Callable[[], Tokenizer], vocab_size: int, eos_token_ids: list[int],
                 max_workers: int = 2) -> None:
        """`load_tokenizer` gives the model's tokenizer; vocab_size is the model's (its logits'
        width, which may exceed the tokenizer's)."""
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        # Loaded on a worker too: for a 128k vocabulary it takes about a second.
        self._tokenizer = self._pool.submit(lambda: _grammar_tokenizer(load_tokenizer(), vocab_size, eos_token_ids))
        self._cache: OrderedDict[str, Future] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> "Future[Matcher]":
        """A future of a fresh matcher for `params`."""
        text = grammar_text(params)
        compiled = self._cache.get(text)
        if compiled is None:
            compiled = self._cache[text] = self._pool.submit(self._build, text)
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(text)
        fresh: Future[Matcher] = Future()
        compiled.add_done_callback(lambda done: _copy_into(done, fresh))
        return fresh

    def _build(self, text: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer.result(), text, log_level=0)
        if matcher.is_error():
            # The gateway checks every constraint first: this one came past it (a direct caller).
            raise GrammarError(matcher.get_error().strip().splitlines()[0])
        return matcher


def _grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    # EOS ids past the tokenizer's vocabulary (a model shape given another model's tokenizer)
    # cannot end a grammar; the tokenizer's own EOS does then.
    eos = [t for t in eos_token_ids if t < tokenizer.vocab_size] or None
    return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)


def _copy_into(compiled: Future, fresh: Future) -> None:
    error = compiled.exception()
    if error is not None:
        fresh.set_exception(error)
    else:
        fresh.set_result(Matcher(compiled.result().deep_copy()))
