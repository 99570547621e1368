"""Pooling requests turned into engine inputs and pooling parameters, rejecting what cannot run."""
from dataclasses import dataclass

from pagedserve.common.chat_template import ChatTemplateError
from pagedserve.common.score_inputs import pair_input
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.gateway import params
from pagedserve.gateway.engine_client import ModelSpec
from pagedserve.gateway.errors import APIError, bad_request
from pagedserve.gateway.pooling import PoolInput
from pagedserve.gateway.pooling_schemas import ClassificationRequest, EmbeddingRequest
from pagedserve.gateway.state import ServedModel
from pagedserve.v1 import engine_pb2 as pb

# LangChain's OpenAIEmbeddings tokenizes with tiktoken and sends those ids unless told otherwise.
LANGCHAIN_HINT = (" If they come from LangChain's OpenAIEmbeddings, which by default sends token ids of OpenAI's "
                  "tokenizer (tiktoken) rather than this model's, create it with check_embedding_ctx_length=False "
                  "so that it sends text.")


@dataclass(slots=True)
class EmbedInputs:
    """An embeddings request's inputs (texts, or token id lists) and how they fit the model: at most
    `keep` tokens of each (None: all), its first ones where `keep_first` (Ollama cuts the end), else its
    last (vLLM's truncate_prompt_tokens); `too_long` tells the client how to fit one still too long."""
    given: list[str] | list[list[int]]
    keep: int | None
    keep_first: bool
    too_long: str
    add_special_tokens: bool = True


def check_task(served: ServedModel, task: str, endpoint: str) -> None:
    """400 when the pooling model does not run `task` (embed or classify)."""
    tasks = served.spec.pooling_tasks
    if task not in tasks:
        raise bad_request(f"The model `{served.name}` serves the pooling task(s) {', '.join(tasks) or 'none'}, not "
                          f"{task}, which {endpoint} needs; send it to a model that serves {task}.", param="model")


def embed_params(req: EmbeddingRequest, served: ServedModel) -> pb.PoolingParams:
    return pb.PoolingParams(task="embed", normalize=req.normalize, dimensions=check_dimensions(req.dimensions, served))


def check_dimensions(dimensions: int | None, served: ServedModel) -> int:
    """The embedding size asked for, 0 for the full size; a 400 unless the model is Matryoshka and
    allows that size: one of its matryoshka_dimensions where it lists them (as vLLM checks), else
    any up to the full size."""
    if dimensions is None:
        return 0
    spec = served.spec
    if not (spec.is_matryoshka or spec.matryoshka_dimensions):
        raise bad_request(f"The model `{served.name}` does not declare Matryoshka support (matryoshka_dimensions in "
                          "its config), so its embeddings cannot be shortened; remove `dimensions`.",
                          param="dimensions")
    listed = spec.matryoshka_dimensions
    if dimensions not in (listed or range(1, spec.embedding_size + 1)):
        sizes = ", ".join(map(str, listed)) if listed else f"1 to {spec.embedding_size}"
        raise bad_request(f"`dimensions` {dimensions} is not a size the model `{served.name}` allows; send one of "
                          f"{sizes}, or none for the full size.", param="dimensions")
    return dimensions


def split_inputs(given: str | list, limit: int) -> list[str] | list[list[int]]:
    """The inputs of an embeddings request: texts, or token id lists."""
    if not given:
        raise bad_request("`input` is empty; send a string, a list of strings or token ids.", param="input")
    inputs = params.split_prompts(given, "input")
    check_count(len(inputs), limit, "input")
    return inputs


def check_count(count: int, limit: int, param: str) -> None:
    if count > limit:
        raise bad_request(f"`{param}` holds {count} items; the limit is {limit} per request "
                          "(--max-client-batch-size). Split it into smaller requests.", param=param)


def check_top_n(top_n: int | None) -> None:
    if top_n is not None and top_n < 0:
        raise bad_request(f"`top_n` is {top_n}; send a positive number, or 0 or none for every document.",
                          param="top_n")


def embedding_inputs(req: EmbeddingRequest | ClassificationRequest, limit: int, max_model_len: int) -> EmbedInputs:
    """/v1/embeddings' (and /classify's) inputs, cut to their last truncate_prompt_tokens tokens, as
    vLLM cuts them."""
    given = split_inputs(req.input, limit)
    too_long = ("Shorten it, or set `truncate_prompt_tokens` (-1: the model's limit) to keep its last tokens."
                + (LANGCHAIN_HINT if not isinstance(given[0], str) else ""))
    return EmbedInputs(given, params.truncation(req.truncate_prompt_tokens, max_model_len), keep_first=False,
                       too_long=too_long, add_special_tokens=req.add_special_tokens)


def encode_texts(tokenizer: Tokenizer, inputs: EmbedInputs, prefix: str) -> list[list[int]]:
    """Each text after `prefix` (the model's default prompt), tokenized and cut as `inputs` says."""
    texts = [prefix + t for t in inputs.given]
    keep = inputs.keep
    if keep is None:
        return [tokenizer.encode(t, inputs.add_special_tokens) for t in texts]
    if inputs.add_special_tokens:
        cut = tokenizer.encode_head if inputs.keep_first else tokenizer.encode_tail
        return [cut(t, keep) for t in texts]
    return [_cut(tokenizer.encode(t, False), inputs) for t in texts]


def check_token_input(inputs: EmbedInputs, vocab_size: int) -> list[list[int]]:
    """Token id inputs, checked against the vocabulary and cut as `inputs` says."""
    for ids in inputs.given:
        try:
            params.check_token_ids(ids, vocab_size, "input")
        except APIError as e:
            raise bad_request(e.info.message + LANGCHAIN_HINT, param="input") from None
    return [_cut(ids, inputs) for ids in inputs.given]


def _cut(ids: list[int], inputs: EmbedInputs) -> list[int]:
    if inputs.keep is None:
        return ids
    return ids[:inputs.keep] if inputs.keep_first else ids[-inputs.keep:]


def check_lengths(prompts: list[list[int]], max_model_len: int, too_long: str) -> None:
    for i, ids in enumerate(prompts):
        if not ids:
            raise bad_request(f"`input` {i} holds no tokens; send some text.", param="input")
        if len(ids) > max_model_len:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, input {i} "
                              f"holds {len(ids)} tokens. {too_long}", param="input", code="context_length_exceeded")


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing of /score's texts: 1:1, 1:N (the first text with each of the second) or N:N."""
    first = [text_1] if isinstance(text_1, str) else text_1
    second = [text_2] if isinstance(text_2, str) else text_2
    if not first or not second:
        raise bad_request("`text_1` and `text_2` each need at least one text.",
                          param="text_1" if not first else "text_2")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise bad_request(f"`text_1` holds {len(first)} texts and `text_2` {len(second)}; pair them 1:1, 1:N or N:N.",
                          param="text_2")
    return list(zip(first, second))


def pair_inputs(tokenizer: Tokenizer, pairs: list[tuple[str, str]], spec: ModelSpec, param: str) -> list[PoolInput]:
    """A cross-encoder's input of each (query, document) pair (see common.score_inputs)."""
    inputs = []
    for i, (query, document) in enumerate(pairs):
        try:
            ids, types = pair_input(tokenizer, query, document)
        except ChatTemplateError as e:
            raise bad_request(f"The model's score template cannot format pair {i}: {e}", param=param) from e
        _check_scored(ids, i, spec.max_model_len, param)
        inputs.append(PoolInput(ids, types))
    return inputs


def text_inputs(tokenizer: Tokenizer, texts: list[str], spec: ModelSpec, param: str) -> list[PoolInput]:
    """A bi-encoder's input of each text that a score compares."""
    inputs = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)
        _check_scored(ids, i, spec.max_model_len, param)
        inputs.append(PoolInput(ids))
    return inputs


def _check_scored(ids: list[int], index: int, max_model_len: int, param: str) -> None:
    if not ids:
        raise bad_request(f"Text {index} to score holds no tokens; send some text.", param=param)
    if len(ids) > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, input {index} "
                          f"to score holds {len(ids)} tokens; shorten the query or the document.", param=param,
                          code="context_length_exceeded")
