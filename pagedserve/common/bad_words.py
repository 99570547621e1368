"""vLLM's bad_words as token id sequences: each word as text starts it, and as a word inside text
starts it (after a space) where the tokenizer writes that as other tokens of the same count
(vLLM's SamplingParams.update_from_tokenizer). The sampler masks a sequence's last id where the
outputs end with its others."""
from pagedserve.common.tokenizer import Tokenizer


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out
