"""Incremental detokenization with stop strings, safe to stream: no partial characters, no stop prefixes."""
from pagedserve.common.tokenizer import Tokenizer

# Prompt tokens kept as decoding context so that the first output token gets its leading space
# (SentencePiece-style decoders strip it at the start of a sequence).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text that is safe to emit now.

    Text ending in U+FFFD (a character whose bytes have not all arrived) and text that could be the
    start of a stop string are held back until they resolve or until flush().
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 prompt_token_ids: list[int] | None = None) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop or [] if s]
        self._include_stop = include_stop_str_in_output
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:]) if prompt_token_ids else []
        # _ids[_prefix:_read] is context already turned into text; _ids[_read:] is still pending.
        self._prefix = 0
        self._read = len(self._ids)
        self._emitted = 0
        self.text = ""
        self.stopped = False
        self.stop_reason: str | None = None

    def add(self, token_ids: list[int]) -> str:
        """Appends new token ids; returns the new text that is safe to emit."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        return self._append(self._decode_pending(final=False))

    def flush(self) -> str:
        """Ends the output: releases everything held back (unless a stop string already matched)
        except a character whose bytes never all arrived."""
        if self.stopped:
            return ""
        # An output cut inside a character (max_tokens) ends before it, as vLLM's does.
        released = self._append(self._decode_pending(final=True).rstrip("\ufffd"))
        return released + self._release(len(self.text))

    def _decode_pending(self, final: bool) -> str:
        prefix = self._tokenizer.decode(self._ids[self._prefix:self._read], self._skip_special)
        full = self._tokenizer.decode(self._ids[self._prefix:], self._skip_special)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(prefix):]

    def _append(self, new: str) -> str:
        if not new:
            return ""
        checked = len(self.text)
        self.text += new
        if not self._stop:
            return self._release(len(self.text))
        if self._match(checked):
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def _match(self, checked: int) -> bool:
        longest = max(len(s) for s in self._stop)
        start = max(0, checked - longest + 1)
        found = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if not found:
            return False
        index, stop = min(found, key=lambda f: f[0])
        self.text = self.text[:index + len(stop) if self._include_stop else index]
        self.stopped = True
        self.stop_reason = stop
        return True

    def _held_back(self) -> int:
        # The longest tail of the text that is a proper prefix of some stop string.
        tail = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), tail, -1):
                if self.text.endswith(stop[:k]):
                    tail = k
                    break
        return tail

    def _release(self, end: int) -> str:
        out = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return out
