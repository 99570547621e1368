"""How a pooling model turns hidden states into an embedding or scores: read from the model
directory's sentence-transformers files and config.json, with vLLM's defaults where they are
silent, then overridden by --pooler-config (vLLM's keys)."""
import json
from dataclasses import dataclass, field
from pathlib import Path

POOLING_TYPES = ("CLS", "MEAN", "LAST")
# sentence-transformers' pooling modes (1_Pooling/config.json) that pagedserve computes. The
# booleans are the format before sentence-transformers 6, `pooling_mode` the one from 6 on.
ST_POOLING_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
ST_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                    "pooling_mode_weightedmean_tokens": "weightedmean"}
# modules.json's modules pagedserve runs, by class name: the transformer itself, its pooling, and
# normalisation; any other (Dense, LayerNorm, ...) would change the vector, so it is refused.
ST_MODULES = ("Transformer", "Pooling", "Normalize")
# A cross-encoder's activation as sentence-transformers saves it: those that leave scores raw.
IDENTITY_ACTIVATIONS = ("torch.nn.modules.linear.Identity", "torch.nn.Identity")
OVERRIDE_KEYS = ("pooling_type", "normalize", "dimensions", "activation", "use_activation")
ENCODERS = ("BertModel", "XLMRobertaModel", "BertForSequenceClassification", "XLMRobertaForSequenceClassification")


@dataclass(slots=True)
class PoolerConfig:
    """pooling_type: CLS (first token), MEAN or LAST (last token) of each sequence. normalize:
    embeddings are L2-normalised by default (a request may say otherwise). dimensions: the
    default Matryoshka truncation, 0 = full size. matryoshka_dimensions: the sizes the model
    declares (empty: none); is_matryoshka: any size up to the hidden size is allowed.
    default_prompt: the instruction sentence-transformers prefixes by default ("" = none).
    num_labels: the classifier's outputs (0: not a classifier); labels: their names by index, as
    config.json's id2label gives them (empty: it names none). activation: classify scores go
    through sigmoid (1 label) or softmax by default."""
    pooling_type: str
    normalize: bool
    dimensions: int = 0
    matryoshka_dimensions: list[int] = field(default_factory=list)
    is_matryoshka: bool = False
    default_prompt: str = ""
    num_labels: int = 0
    labels: list[str] = field(default_factory=list)
    activation: bool = True


def load_pooler_config(model_dir: str | Path, overrides: dict | None = None,
                       hf_overrides: dict | None = None) -> PoolerConfig:
    """The pooler config of the model at `model_dir` (a directory, or a GGUF file, which has no
    sentence-transformers files), its config.json updated by `hf_overrides` (--hf-overrides),
    then `overrides` (--pooler-config) applied. Raises ValueError, in one line, for a pooling or
    module pagedserve does not run, or an override it does not know."""
    model_dir = Path(model_dir)
    hf_config = {**_read_json(model_dir / "config.json"), **(hf_overrides or {})}
    architecture = (hf_config.get("architectures") or [""])[0]
    st_config = _read_json(model_dir / "config_sentence_transformers.json")
    labels = num_labels(hf_config) if architecture.endswith("ForSequenceClassification") else 0
    config = PoolerConfig(
        # vLLM's defaults: an encoder pools its first token (BERT's [CLS]), a decoder its last;
        # embeddings are normalised.
        pooling_type="CLS" if architecture in ENCODERS else "LAST",
        normalize=labels == 0,
        matryoshka_dimensions=list(hf_config.get("matryoshka_dimensions") or []),
        is_matryoshka=bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions")),
        default_prompt=_default_prompt(st_config),
        num_labels=labels,
        labels=label_names(hf_config, labels),
        activation=_activation(st_config, hf_config))
    _apply_st_modules(config, model_dir, overrides or {})
    return apply_overrides(config, overrides or {})


def apply_overrides(config: PoolerConfig, overrides: dict) -> PoolerConfig:
    """`config` with --pooler-config's keys (vLLM's: pooling_type, normalize, dimensions,
    activation or use_activation) set."""
    unknown = sorted(overrides.keys() - set(OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"--pooler-config has unknown keys {unknown}; pagedserve takes {', '.join(OVERRIDE_KEYS)}")
    if "pooling_type" in overrides:
        config.pooling_type = _pooling_type(overrides["pooling_type"])
    if "normalize" in overrides:
        config.normalize = bool(overrides["normalize"])
    for key in ("activation", "use_activation"):
        if key in overrides:
            config.activation = bool(overrides[key])
    if "dimensions" in overrides:
        config.dimensions = _dimensions(config, overrides["dimensions"])
    return config


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def num_labels(hf_config: dict) -> int:
    """A classifier's number of outputs: one for a yes/no-token reranker (vLLM's
    classifier_from_token: the score is logit(yes) - logit(no)), else config.json's num_labels
    or the size of its id2label (what transformers saves)."""
    if hf_config.get("classifier_from_token"):
        return 1
    return int(hf_config.get("num_labels") or len(hf_config.get("id2label") or {}) or 2)


def label_names(hf_config: dict, count: int) -> list[str]:
    """config.json's id2label as a list by index, when it names each of the `count` outputs."""
    id2label = hf_config.get("id2label") or {}
    names = [id2label.get(str(i), id2label.get(i)) for i in range(count)]
    return names if count and None not in names else []


def _default_prompt(st_config: dict) -> str:
    name = st_config.get("default_prompt_name")
    return (st_config.get("prompts") or {}).get(name, "") if name else ""


def _activation(st_config: dict, hf_config: dict) -> bool:
    """False when sentence-transformers saved the cross-encoder with an Identity activation (in
    config_sentence_transformers.json from version 6, in config.json's `sentence_transformers`
    before), which asks for raw logits."""
    name = st_config.get("activation_fn") or (hf_config.get("sentence_transformers") or {}).get("activation_fn")
    return name not in IDENTITY_ACTIVATIONS


def _apply_st_modules(config: PoolerConfig, model_dir: Path, overrides: dict) -> None:
    """The pooling and normalisation of an embedding model's sentence-transformers pipeline
    (modules.json), when it has one: without a Normalize module its vectors are raw."""
    modules = _read_json(model_dir / "modules.json") if model_dir.is_dir() else []
    names = [module["type"].rpartition(".")[2] for module in modules]
    unsupported = [name for name in names if name not in ST_MODULES]
    if unsupported:
        raise ValueError(f"{model_dir}/modules.json has {', '.join(unsupported)} modules, which pagedserve "
                         f"does not run; it runs {', '.join(ST_MODULES)}")
    if "Pooling" not in names:
        return
    config.normalize = "Normalize" in names
    path = model_dir / modules[names.index("Pooling")]["path"] / "config.json"
    config.pooling_type = _st_pooling_type(path, config.pooling_type, "pooling_type" in overrides)


def _st_pooling_type(path: Path, default: str, overridden: bool) -> str:
    """The pooling type a sentence-transformers Pooling config names (in either format); for one
    pagedserve does not compute, `default` if --pooler-config sets the pooling type, else raises."""
    pooling = _read_json(path)
    modes = pooling.get("pooling_mode")
    modes = [modes] if isinstance(modes, str) else [mode for key, mode in ST_POOLING_FLAGS.items() if pooling.get(key)]
    whole = pooling.get("include_prompt", True)
    if len(modes) == 1 and modes[0] in ST_POOLING_MODES and whole:
        return ST_POOLING_MODES[modes[0]]
    if overridden:
        return default
    what = f"pooling {'+'.join(modes) or 'none'}" + ("" if whole else " without the prompt")
    raise ValueError(f"{path} asks for {what}; pagedserve pools one of {', '.join(ST_POOLING_MODES)} over "
                     "every token: set --pooler-config '{\"pooling_type\": \"MEAN\"}' (or CLS, LAST)")


def _pooling_type(value: object) -> str:
    name = str(value).upper()
    if name not in POOLING_TYPES:
        raise ValueError(f"--pooler-config pooling_type {value!r} is not supported; use one of {', '.join(POOLING_TYPES)}")
    return name


def _dimensions(config: PoolerConfig, value: object) -> int:
    """--pooler-config's default `dimensions`, which needs a model that declares Matryoshka
    support (a declared size, or any with is_matryoshka)."""
    if value is None:
        return 0
    if not config.is_matryoshka:
        raise ValueError("--pooler-config dimensions needs a Matryoshka model (config.json's matryoshka_dimensions "
                         "or is_matryoshka); this model declares neither, so leave dimensions out")
    if config.matryoshka_dimensions and value not in config.matryoshka_dimensions:
        raise ValueError(f"--pooler-config dimensions {value} is not one of the model's matryoshka_dimensions "
                         f"{config.matryoshka_dimensions}")
    return int(value)
