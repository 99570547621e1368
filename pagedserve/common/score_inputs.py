"""A (query, document) pair as one classifier input, formed as vLLM forms it for each kind of reranker.

- A tokenizer whose chat template is a score template (it renders the roles "query" and "document",
  e.g. vLLM's examples/pooling/score/template/qwen3_reranker.jinja passed with --chat-template):
  the template renders the pair and the text is encoded as it stands (the template writes any BOS).
- A tokenizer whose pair template separates the texts (BERT's [SEP], XLM-R's </s></s>): a
  cross-encoder's pair, with the token types of that template.
- Otherwise (a decoder reranker served without a score template): the texts joined, vLLM's
  use_sep_token=False for an "LLM as reranker".
"""
from pagedserve.common.tokenizer import Tokenizer


def pair_input(tokenizer: Tokenizer, query: str, document: str) -> tuple[list[int], list[int]]:
    """The pair's token ids and their token types (empty: all zeros). Raises ChatTemplateError when
    the score template fails."""
    if tokenizer.has_score_template:
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        text = tokenizer.render_chat(tokenizer.chat_variables(messages, False, None, None))
        return tokenizer.encode(text, add_special_tokens=False), []
    if tokenizer.separates_pairs:
        ids, types = tokenizer.encode_pair(query, document)
        return ids, types if any(types) else []
    return tokenizer.encode(query + document), []
