"""What the worker needs to serve a model with the pooling runner: which runner --runner/--task
pick for the model, the pooler (its pooling, defaults and classifier head) and the facts Describe
reports about it."""
from pathlib import Path

from torch import nn

from pagedserve.common.config import TASK_RUNNERS, EngineConfig
from pagedserve.common.plan import PoolingInfo
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.models import ENCODERS
from pagedserve.executor_svc.pooler import Head, Pooler, from_token_classifier
from pagedserve.executor_svc.pooler_config import PoolerConfig


def resolve_runner(config: EngineConfig, model: ModelConfig) -> str:
    """"generate" or "pooling": --runner, else --task's runner; auto picks pooling for an encoder,
    a sequence classifier (a yes/no-token reranker too) or a sentence-transformers directory."""
    runner = config.runner
    if runner == "auto" and config.task is not None:
        runner = TASK_RUNNERS[config.task]
    if runner == "auto":
        runner = "pooling" if is_pooling_model(config.model, model) else "generate"
    if runner == "generate" and model.architecture in ENCODERS:
        raise ValueError(f"{model.architecture} is an encoder, which only pools: drop --runner generate "
                         "(or use --runner pooling)")
    return runner


def is_pooling_model(path: str, model: ModelConfig) -> bool:
    architectures = model.hf_config.get("architectures") or []
    return (model.architecture in ENCODERS or bool(model.hf_config.get("classifier_from_token"))
            or any(name.endswith("ForSequenceClassification") for name in architectures)
            or (Path(path) / "modules.json").is_file())


def build_pooler(model: nn.Module, model_config: ModelConfig, pooler_config: PoolerConfig,
                 tokenizer_path: str) -> Pooler:
    """The pooler of `pooler_config` with the model's classifier head when it classifies."""
    head = None
    if pooler_config.num_labels:
        head = model.classify if hasattr(model, "classify") else _token_head(model, model_config, tokenizer_path)
    return Pooler(pooler_config.pooling_type, pooler_config.normalize, pooler_config.dimensions,
                  pooler_config.activation, head)


def _token_head(model: nn.Module, model_config: ModelConfig, tokenizer_path: str) -> Head:
    """A decoder's classifier from its lm_head rows (vLLM's classifier_from_token [false, true])."""
    tokens = model_config.hf_config.get("classifier_from_token") or []
    if len(tokens) != 2 or not model_config.hf_config.get("is_original_qwen3_reranker"):
        raise ValueError(f"{model_config.architecture} has no classifier: a decoder classifies with "
                         "--hf-overrides classifier_from_token [\"no\", \"yes\"] and "
                         "is_original_qwen3_reranker true (a Qwen3-Reranker)")
    vocab = Tokenizer.load(tokenizer_path)
    false_id, true_id = (vocab.token_id(t) for t in tokens)
    return from_token_classifier(model.head_weight(), true_id, false_id)


def pooling_info(model_config: ModelConfig, pooler_config: PoolerConfig) -> PoolingInfo:
    classify = pooler_config.num_labels > 0
    return PoolingInfo(tasks=["classify" if classify else "embed"], embedding_size=model_config.hidden_size,
                       matryoshka_dimensions=list(pooler_config.matryoshka_dimensions),
                       is_matryoshka=pooler_config.is_matryoshka, num_labels=pooler_config.num_labels,
                       default_prompt=pooler_config.default_prompt, labels=list(pooler_config.labels))
