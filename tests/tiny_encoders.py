"""Tiny random encoder models (BERT, XLM-RoBERTa and their sequence classifiers) saved as
transformers saves them, each with a tokenizer.json that transformers and pagedserve's Tokenizer
read alike; and sentence-transformers model directories built on them (modules.json,
1_Pooling/, 2_Normalize/, config_sentence_transformers.json as sentence-transformers writes them)."""
import json
import random
import string
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "BertForSequenceClassification",
                         "XLMRobertaForSequenceClassification")
# The model's vocabulary; the tokenizers' use its first ids, the rest are for random token ids.
VOCAB_SIZE = 256
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, layer_norm_eps=1e-12, hidden_act="gelu",
              # Wider than transformers' 0.02 so outputs spread out and a wrong piece shows.
              initializer_range=0.1)
BERT = dict(COMMON, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0)
# XLM-R's positions start at pad_token_id + 1, so it holds 2 more than its longest input.
XLM_ROBERTA = dict(COMMON, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                   eos_token_id=2, layer_norm_eps=1e-5)
# The longest input the tiny models take.
MAX_LEN = 128
WORDS = ("the", "a", "of", "to", "and", "is", "in", "what", "capital", "france", "paris", "berlin",
         "germany", "city", "river", "query", "passage", "document")
# Prompts as sentence-transformers' config_sentence_transformers.json holds them (e5's style).
PROMPTS = {"query": "query: ", "passage": "passage: "}


def make_rag_models(root: Path, embedder: str, reranker: str) -> dict[str, Path]:
    """A sentence-transformers embedder and a BERT cross-encoder under `root`, by served name."""
    return {embedder: make_sentence_transformer(root / "embedder"),
            reranker: make_tiny_encoder("BertForSequenceClassification", root / "reranker")}


def make_tiny_encoder(arch: str, path: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Saves a seeded float32 2-layer `arch` (one of ENCODER_ARCHITECTURES) with its tokenizer in
    `path`; returns it. A classifier has config_overrides' num_labels (default 1, a reranker's)."""
    path = Path(path)
    xlm = arch.startswith("XLMRoberta")
    fields = {**(XLM_ROBERTA if xlm else BERT), **config_overrides}
    if arch.endswith("ForSequenceClassification"):
        fields.setdefault("num_labels", 1)
    config_class = transformers.XLMRobertaConfig if xlm else transformers.BertConfig
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config_class(**fields)).to(torch.float32).eval()
    # transformers initialises LayerNorm weights to 1 and biases to 0, which would hide a dropped
    # or swapped one; randomise them too.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm.weight" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, xlm)
    return path


def save_tokenizer(path: Path, xlm: bool) -> None:
    """tokenizer.json and tokenizer_config.json: BERT's WordPiece with [CLS] A [SEP] B [SEP] and
    token types, or XLM-R's unigram pieces with <s> A </s></s> B </s>."""
    tokenizer, config = _xlm_tokenizer() if xlm else _bert_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    # PreTrainedTokenizerFast reads tokenizer.json as it is; BertTokenizer and XLMRobertaTokenizer
    # rebuild their pipelines from the vocabulary in transformers 5.
    config = dict(config, tokenizer_class="PreTrainedTokenizerFast", model_max_length=MAX_LEN)
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _bert_tokenizer() -> tuple[Tokenizer, dict]:
    chars = list(string.ascii_lowercase + string.digits)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars), *WORDS]
    tokenizer = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.decoder = decoders.WordPiece()
    config = dict(cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]",
                  model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    return tokenizer, config


def _xlm_tokenizer() -> tuple[Tokenizer, dict]:
    pieces = ["▁" + w for w in WORDS] + ["▁", *string.ascii_lowercase, *string.digits]
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("<mask>", 0.0)]
    vocab += [(piece, -1.0 - i / 10) for i, piece in enumerate(pieces)]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=False))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer.decoder = decoders.Metaspace()
    config = dict(bos_token="<s>", cls_token="<s>", eos_token="</s>", sep_token="</s>", pad_token="<pad>",
                  unk_token="<unk>", mask_token="<mask>", model_input_names=["input_ids", "attention_mask"])
    return tokenizer, config


def make_sentence_transformer(path: str | Path, pooling: str = "mean", normalize: bool = True,
                              arch: str = "BertModel", default_prompt_name: str | None = None,
                              seed: int = 0, **config_overrides) -> Path:
    """A sentence-transformers model directory, as SentenceTransformer.save writes it: a tiny
    `arch` encoder, Pooling (`pooling`: "mean", "cls" or "lasttoken"), Normalize when
    `normalize`, PROMPTS with `default_prompt_name` (None: no default prompt); returns `path`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    path = Path(path)
    encoder = make_tiny_encoder(arch, path.with_name(path.name + "-encoder"), seed, **config_overrides)
    transformer = Transformer(str(encoder), max_seq_length=MAX_LEN)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling)]
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, prompts=PROMPTS, default_prompt_name=default_prompt_name,
                                device="cpu")
    model.save(str(path))
    return path


def random_inputs(lens: list[int], seed: int, cls_id: int,
                  type_ids: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """Random token ids of each length in `lens`, the first `cls_id` (CLS, or XLM-R's <s>, as a
    tokenizer puts it; no special or pad id after it), and their token type ids: a random split
    into a first and second segment (a pair) when `type_ids`, else zeros."""
    rng = random.Random(seed)
    ids, types = [], []
    for n in lens:
        ids.append([cls_id] + [rng.randrange(5, VOCAB_SIZE) for _ in range(n - 1)])
        split = rng.randrange(1, n + 1) if type_ids else n
        types.append([0] * split + [1] * (n - split))
    return ids, types
