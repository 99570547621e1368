"""Token log probabilities from the engine, as chat and completions bodies carry them."""
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.gateway.schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, TopLogprob
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.v1 import engine_pb2 as pb

# OpenAI's stand-in for a logprob too small to report (JSON has no -Infinity).
_FLOOR = -9999.0


@dataclass(slots=True)
class TokenLogprob:
    """One token: its id and text, its logprob and rank (1 = most likely), and the most likely tokens'
    (id, text, logprob), most likely first; a prompt's first token has no logprob or rank (None).
    The one form every wire reads, for output and prompt tokens alike."""
    token_id: int
    token: str
    logprob: float | None
    rank: int | None
    top: list[tuple[int, str, float]]


def token_text(tokenizer: Tokenizer, token_id: int, as_ids: bool = False) -> str:
    """A token on its own, special tokens included; one holding part of a character reads as
    U+FFFD (as in vLLM). With `as_ids` it reads "token_id:N" (vLLM's return_tokens_as_token_ids:
    a client that maps tokens back to ids needs no tokenizer)."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id], skip_special_tokens=False)


def decode_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[pb.TokenLogprobs],
                    as_ids: bool = False) -> list[TokenLogprob]:
    """Each token with its logprobs, named as token_text names it."""
    return [TokenLogprob(token_id, token_text(tokenizer, token_id, as_ids), max(lp.logprob, _FLOOR), lp.rank,
                         [(t, token_text(tokenizer, t, as_ids), max(p, _FLOOR))
                          for t, p in zip(lp.top_token_ids, lp.top_logprobs)])
            for token_id, lp in zip(token_ids, logprobs)]


def decode_prompt(tokenizer: Tokenizer, prompt_ids: list[int], logprobs: Sequence[pb.TokenLogprobs],
                  as_ids: bool = False) -> list[TokenLogprob]:
    """A prompt's tokens: the first without a logprob (nothing comes before it), then one per entry."""
    first = TokenLogprob(prompt_ids[0], token_text(tokenizer, prompt_ids[0], as_ids), None, None, [])
    return [first, *decode_logprobs(tokenizer, prompt_ids[1:], logprobs, as_ids)]


def prompt_logprobs(tokens: list[TokenLogprob] | None) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: None for the first token, then per token {id: its logprob, rank and
    text}, the prompt token first and then the top ones."""
    out: list[dict[str, PromptLogprob] | None] = [None]
    for t in (tokens or [])[1:]:
        position = {str(t.token_id): PromptLogprob(t.logprob, t.rank, t.token)}
        for rank, (top_id, text, logprob) in enumerate(t.top, 1):
            position.setdefault(str(top_id), PromptLogprob(logprob, rank, text))
        out.append(position)
    return out


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(tokens: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs([ChatTokenLogprob(t.token, t.logprob, _bytes(t.token),
                                          [TopLogprob(s, p, _bytes(s)) for _, s, p in t.top])
                         for t in tokens])


def completion_logprobs(tokens: list[TokenLogprob], text_offset: int) -> tuple[CompletionLogprobs, int]:
    """`text_offset`: where the first token starts in the choice's text; also returns where the
    next one would. Offsets add up token texts (as vLLM's do)."""
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t.token)
    # OpenAI's legacy format includes the sampled token among the top ones.
    body = CompletionLogprobs([t.token for t in tokens], [t.logprob for t in tokens],
                              [None if t.logprob is None else {s: p for _, s, p in t.top} | {t.token: t.logprob}
                               for t in tokens], offsets)
    return body, text_offset
