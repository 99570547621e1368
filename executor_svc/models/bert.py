"""The encoders: BERT (bge-small/base, e5, all-MiniLM) and XLM-RoBERTa (bge-m3), and their
sequence classifiers (cross-encoder rerankers such as bge-reranker). Post-norm layers of
bidirectional attention and a GELU MLP over absolute position and token type embeddings; a
batch is its sequences packed one after another, attended each on its own, with no KV cache.

Parameter names are transformers', without the `bert.`/`roberta.` prefix a classifier's
checkpoint puts on the encoder's, and with query/key/value fused as `attention.qkv_proj`.
Family-only config.json fields (layer_norm_eps, type_vocab_size, pad_token_id, ...) are read
from ModelConfig.hf_config."""
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.common.log import get_logger
from pagedserve.executor_svc.layers.encoder_attention import PackedSequences, attend, pack_sequences
from pagedserve.executor_svc.layers.linear import CheckpointLinear, Embedding, MergedLinear
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.pooler_config import num_labels

log = get_logger(__name__)
T = TypeVar("T")

# hidden_act -> its function: BERT's exact GELU and the approximations some checkpoints name.
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
               "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# transformers' BertConfig defaults for the family fields a config.json may leave out.
BERT_DEFAULTS = dict(hidden_act="gelu", layer_norm_eps=1e-12, type_vocab_size=2, pad_token_id=0,
                     position_embedding_type="absolute")
# Checkpoint prefixes of the encoder inside a classifier (and inside a masked LM).
PREFIXES = ("bert.", "roberta.")
# Tensors older checkpoints hold that the model does not: its position ids buffer.
IGNORED = ("embeddings.position_ids",)


class Embeddings(nn.Module):
    """Word + absolute position + token type embeddings, then LayerNorm. Positions are each
    token's index within its sequence plus `position_offset` (XLM-R's start at pad + 1)."""

    def __init__(self, config: ModelConfig, position_offset: int) -> None:
        super().__init__()
        hf, hidden = config.hf_config, config.hidden_size
        self.word_embeddings = Embedding(config.vocab_size, hidden)
        self.position_embeddings = Embedding(config.max_position_embeddings + position_offset, hidden)
        self.token_type_embeddings = Embedding(hf["type_vocab_size"], hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=hf["layer_norm_eps"])
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions + self.position_offset))


class DenseNorm(nn.Module):
    """LayerNorm(dense(x) + residual): the end of each half of a post-norm layer."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = CheckpointLinear(in_features, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Dense(nn.Module):
    """A Linear where the checkpoint names one module `<name>.dense` (BERT's intermediate)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.dense = CheckpointLinear(in_features, out_features)


class SelfAttention(nn.Module):
    """Fused query/key/value (checkpoint `attention.self.{query,key,value}`), attention within
    each sequence, and `attention.output`'s projection, residual add and LayerNorm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.qkv_proj = MergedLinear(hidden, {"self.query": hidden, "self.key": hidden, "self.value": hidden}, True)
        self.output = DenseNorm(hidden, hidden, config.hf_config["layer_norm_eps"])
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim

    def forward(self, x: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
        q, k, v = (t.view(-1, self.num_heads, self.head_dim) for t in self.qkv_proj(x).chunk(3, dim=-1))
        return self.output(attend(q, k, v, packed).flatten(1), x)


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.hf_config["layer_norm_eps"]
        self.attention = SelfAttention(config)
        self.intermediate = Dense(hidden, config.intermediate_size)
        self.output = DenseNorm(config.intermediate_size, hidden, eps)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
        x = self.attention(x, packed)
        return self.output(self.act(self.intermediate.dense(x)), x)


class Encoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder: embeddings and post-norm layers. Built by models.build_model; the weight
    loader fills its parameters."""
    hidden_acts = tuple(ACTIVATIONS)
    # Checkpoint tensors of heads this model does not run (BERT's pooler, a masked LM's head):
    # skipped at load, with a log line.
    unused_prefixes = ("pooler.", "cls.", "lm_head.")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config, self.position_offset_of(config))
        self.encoder = Encoder(config)

    @staticmethod
    def position_offset_of(config: ModelConfig) -> int:
        return 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
        """input_ids, positions (0-based within each sequence), token_type_ids [T] of sequences of
        `seq_lens` tokens packed one after another -> hidden states [T, hidden_size]."""
        x = self.embeddings(input_ids, positions, token_type_ids)
        packed = pack_sequences(seq_lens, x.device, x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, packed)
        return x

    @staticmethod
    def read_hf_config(config: dict) -> dict:
        """config.json with BertConfig's defaults; refuses relative position embeddings."""
        config = {**BERT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        if config["position_embedding_type"] != "absolute":
            raise ValueError(f"position_embedding_type {config['position_embedding_type']!r} is not supported; "
                             "pagedserve runs BERT and XLM-RoBERTa with absolute position embeddings")
        return config

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, T]]) -> Iterator[tuple[str, T]]:
        """The checkpoint's tensors without the encoder's `bert.`/`roberta.` prefix, less those
        of heads this model does not run."""
        skipped = []
        for name, tensor in tensors:
            name = next((name.removeprefix(p) for p in PREFIXES if name.startswith(p)), name)
            if name.startswith(self.unused_prefixes) or name in IGNORED:
                skipped.append(name)
                continue
            yield name, tensor
        if skipped:
            log.info("checkpoint_tensors_skipped", model=type(self).__name__, tensors=len(skipped),
                     names=sorted({n.partition(".")[0] for n in skipped}))


class XLMRobertaModel(BertModel):
    """BERT with positions that start after the padding id (pad_token_id + 1), as fairseq's
    RoBERTa numbers them; one token type. max_position_embeddings counts the usable positions
    (514 rows hold 512)."""

    @staticmethod
    def position_offset_of(config: ModelConfig) -> int:
        return config.hf_config["pad_token_id"] + 1

    @staticmethod
    def read_hf_config(config: dict) -> dict:
        config = BertModel.read_hf_config({"pad_token_id": 1, **config})
        return {**config, "max_position_embeddings": config["max_position_embeddings"] - config["pad_token_id"] - 1}


class BertForSequenceClassification(BertModel):
    """BERT and its classifier: the pooler (dense + tanh on [CLS]), then a linear layer to
    num_labels scores."""
    unused_prefixes = ("cls.", "lm_head.")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.pooler = Dense(config.hidden_size, config.hidden_size)
        self.classifier = CheckpointLinear(config.hidden_size, num_labels(config.hf_config))

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        """Each sequence's first-token hidden state [B, hidden] -> its scores [B, num_labels],
        before any activation."""
        return self.classifier(torch.tanh(self.pooler.dense(first_token_hidden)))


class ClassificationHead(nn.Module):
    """RoBERTa's head: dense + tanh on <s>, then out_proj to num_labels scores."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = CheckpointLinear(config.hidden_size, config.hidden_size)
        self.out_proj = CheckpointLinear(config.hidden_size, num_labels(config.hf_config))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.classifier = ClassificationHead(config)

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        """As BertForSequenceClassification.classify, through RoBERTa's head."""
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(first_token_hidden)))

