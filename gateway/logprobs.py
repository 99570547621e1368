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
    """One token as text, its logprob, and the most likely tokens' (most likely first); a prompt's
    first token has no logprob (None)."""
    token: str
    logprob: float | None
    top: list[tuple[str, float]]


def decode_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int],
                    logprobs: Sequence[pb.TokenLogprobs]) -> list[TokenLogprob]:
    """Each token on its own, special tokens included; a token holding part of a character reads
    as U+FFFD (as in vLLM)."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return [TokenLogprob(text(token_id), max(lp.logprob, _FLOOR),
                         [(text(t), max(p, _FLOOR)) for t, p in zip(lp.top_token_ids, lp.top_logprobs)])
            for token_id, lp in zip(token_ids, logprobs)]


def echo_logprobs(tokenizer: Tokenizer, prompt_ids: list[int],
                  logprobs: Sequence[pb.TokenLogprobs]) -> list[TokenLogprob]:
    """The prompt's tokens for `echo`: the first without a logprob, as OpenAI returns it."""
    first = TokenLogprob(tokenizer.decode(prompt_ids[:1], skip_special_tokens=False), None, [])
    return [first, *decode_logprobs(tokenizer, prompt_ids[1:], logprobs)]


def prompt_logprobs(tokenizer: Tokenizer, prompt_ids: list[int],
                    logprobs: Sequence[pb.TokenLogprobs]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: None for the first token, then per token {id: its logprob, rank and
    text}, the prompt token first and then the top ones."""
    def entry(token_id: int, logprob: float, rank: int) -> PromptLogprob:
        return PromptLogprob(max(logprob, _FLOOR), rank, tokenizer.decode([token_id], skip_special_tokens=False))

    out: list[dict[str, PromptLogprob] | None] = [None]
    for token_id, lp in zip(prompt_ids[1:], logprobs):
        position = {str(token_id): entry(token_id, lp.logprob, lp.rank)}
        for rank, (t, p) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), 1):
            position.setdefault(str(t), entry(t, p, rank))
        out.append(position)
    return out


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(tokens: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs([ChatTokenLogprob(t.token, t.logprob, _bytes(t.token),
                                          [TopLogprob(s, p, _bytes(s)) for s, p in t.top])
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
                              [None if t.logprob is None else dict(t.top) | {t.token: t.logprob}
                               for t in tokens], offsets)
    return body, text_offset
