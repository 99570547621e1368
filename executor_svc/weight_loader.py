"""Loads a checkpoint (Hugging Face safetensors or GGUF) into the model, or fills it with dummy
weights. Under tensor parallelism each rank reads only its slice of each tensor."""
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.common.log import get_logger
from pagedserve.executor_svc.fp8 import (Quantize, fp8_experts, fp8_linears, quantize_experts,
                                         quantize_linears)
from pagedserve.executor_svc.gguf_file import find_gguf, read_gguf_tensors
from pagedserve.kernels.reference import FP8_DTYPE

log = get_logger(__name__)

# Old Llama checkpoints saved the rotary inverse frequencies; the model builds its own. FP8
# checkpoints may hold static activation scales: pagedserve quantizes activations per token
# instead, a finer scale than one per tensor.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".input_scale")
SCALE_SUFFIX = ".weight_scale"
# Calibrated FP8 KV-cache scales, optional: vLLM's names and compressed-tensors' older ones, each
# into its attention layer's buffer (used only when the cache is fp8).
KV_SCALE_SUFFIXES = {".self_attn.k_scale": "k_scale", ".self_attn.v_scale": "v_scale",
                     ".self_attn.k_proj.output_scale": "k_scale", ".self_attn.v_proj.output_scale": "v_scale"}
DUMMY_STD = 0.02

# A checkpoint tensor's slice, one slice per leading dim; None for the whole tensor.
Index = tuple[slice, ...] | None
# A tensor of every expert of a layer at once, [E, ...]: transformers 5's fused gate_up_proj
# [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I], or a GGUF file's ffn_*_exps as
# gguf_file names them. Split into the per-expert tensors Hugging Face checkpoints hold.
STACKED_EXPERTS = re.compile(r"(.+\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?")


@dataclass(slots=True)
class CheckpointTensor:
    """One tensor of a checkpoint: its shape, and a reader of the whole tensor or a slice."""
    shape: tuple[int, ...]
    read: Callable[[Index], torch.Tensor]


@dataclass(slots=True)
class Target:
    """Where one checkpoint tensor goes: rows [start, start + size) of `param`, which take the
    rank-th of `parts` equal slices of the tensor along `dim` (the whole tensor when parts is 1)."""
    param: torch.Tensor
    start: int
    size: int
    dim: int = 0
    rank: int = 0
    parts: int = 1
    # A stacked parameter ([E, ...], a mixture of experts'): the rows are those of param[expert].
    expert: int | None = None

    @property
    def view(self) -> torch.Tensor:
        param = self.param if self.expert is None else self.param[self.expert]
        return param[self.start:self.start + self.size]

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        shape = list(self.view.shape)
        shape[self.dim] *= self.parts
        return tuple(shape)

    def index(self) -> Index:
        if self.parts == 1:
            return None
        n = self.view.shape[self.dim]
        return (slice(None),) * self.dim + (slice(self.rank * n, (self.rank + 1) * n),)


def load_weights(model: nn.Module, model_path: str | Path, load_format: str, seed: int = 0,
                 quantize: Quantize | None = None) -> None:
    """Fills every parameter: `auto` from the GGUF file that `model_path` names or else the
    directory's *.safetensors, `safetensors` from those only, `dummy` with seeded random values
    (norm weights 1, biases 0) without reading any weight file.

    With `quantize` (the backend's per-token FP8 quantizer) the decoder's projections and experts
    run in FP8: an FP8 checkpoint loads as it is, any other is quantized per output channel once
    loaded."""
    serialized = quantize is not None and model.config.quantization == "fp8" and load_format != "dummy"
    if serialized:
        fp8_linears(model, quantize)
        fp8_experts(model)
    _fill(model, model_path, load_format, seed)
    if quantize is not None and not serialized:
        quantize_linears(model, quantize)
        quantize_experts(model)


def _fill(model: nn.Module, model_path: str | Path, load_format: str, seed: int) -> None:
    if load_format == "dummy":
        load_checkpoint(model, dummy_tensors(model, seed), "dummy weights")
    elif load_format == "auto" and (gguf_path := find_gguf(model_path)) is not None:
        tensors = ((name, CheckpointTensor(shape, read)) for name, shape, read in read_gguf_tensors(gguf_path))
        load_checkpoint(model, tensors, gguf_path)
    elif load_format in ("auto", "safetensors"):
        device = next(model.parameters()).device
        load_checkpoint(model, read_safetensors(Path(model_path), device), model_path)
    else:
        raise ValueError(f"unknown --load-format {load_format!r}; use auto, safetensors or dummy")


def dummy_tensors(model: nn.Module, seed: int) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint `model` would load, made up: seeded random matrices, norm weights 1, biases
    0. A rank draws each whole matrix and keeps its slice, so every -tp gets the same weights."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, target in checkpoint_targets(model).items():
        if target is None:
            continue
        shape, dtype = target.checkpoint_shape, target.param.dtype
        if name.lower().endswith("norm.weight"):
            whole = torch.ones(shape, dtype=dtype, device=device)
        elif len(shape) == 1:
            whole = torch.zeros(shape, dtype=dtype, device=device)
        else:
            whole = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, DUMMY_STD, generator=generator)
        yield name, CheckpointTensor(shape, lambda index, t=whole: t if index is None else t[index])


@torch.no_grad()
def load_checkpoint(model: nn.Module, tensors: Iterable[tuple[str, CheckpointTensor]],
                    source: str | Path) -> None:
    """Copies each (Hugging Face name, tensor), as the model's checkpoint_tensors names and
    converts it, into the parameter slice the name maps to (a fused tensor such as Phi-3's
    qkv_proj into each of the shards it stacks; a stacked experts tensor per expert,
    STACKED_EXPERTS), reading one tensor (this rank's slice of it) at a time; every parameter
    must be filled and every tensor used."""
    targets, fused = checkpoint_targets(model), fused_tensors(model)
    # A tied model has no lm_head, yet some tied checkpoints still store a copy of the embeddings.
    tied = "lm_head.weight" not in targets
    loaded, unexpected = set(), []
    for name, tensor in _per_expert(model.checkpoint_tensors(tensors)):
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if (kv_scale := _kv_scale_buffer(model, name)) is not None:
            kv_scale.copy_(tensor.read(None).reshape(()))
            continue
        # The "fp8" quant_method's name for the same multiplier (w = q * scale) as weight_scale.
        name = name.removesuffix("_inv") if name.endswith(SCALE_SUFFIX + "_inv") else name
        for part_name, part in _unfuse(name, tensor, fused.get(name), targets):
            if part_name not in targets:
                unexpected.append(part_name)
                continue
            if (target := targets[part_name]) is not None:
                _copy(part_name, part, target)
            loaded.add(part_name)
    missing = sorted(targets.keys() - loaded)
    if missing or unexpected:
        raise ValueError(f"checkpoint {source} does not match {type(model).__name__}: "
                         f"missing {_few(missing)}, unexpected {_few(unexpected)}; is it a "
                         f"complete checkpoint of the architecture its config names?")
    log.info("weights_loaded", model=str(source), tensors=len(loaded))


def _per_expert(tensors: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
    """Passes each tensor on, but a stacked experts tensor (STACKED_EXPERTS) as its experts'
    tensors `<block>.experts.{e}.{gate,up,down}_proj.weight`, each reading only its rows."""
    for name, tensor in tensors:
        match = STACKED_EXPERTS.fullmatch(name)
        if match is None or len(tensor.shape) != 3:
            yield name, tensor
            continue
        block, projection = match.groups()
        parts = ("gate_proj", "up_proj") if projection == "gate_up_proj" else (projection,)
        rows = tensor.shape[1] // len(parts)
        for expert in range(tensor.shape[0]):
            for i, part in enumerate(parts):
                yield f"{block}.{expert}.{part}.weight", _expert_rows(tensor, expert, i * rows, rows)


def _expert_rows(tensor: CheckpointTensor, expert: int, start: int, rows: int) -> CheckpointTensor:
    """Rows [start, start + rows) of one expert's matrix in a stacked [E, N, K] tensor."""
    return CheckpointTensor((rows, tensor.shape[2]),
                            lambda index: tensor.read((expert, *_rows(index, start, rows))))


def _kv_scale_buffer(model: nn.Module, name: str) -> torch.Tensor | None:
    suffix = next((s for s in KV_SCALE_SUFFIXES if name.endswith(s)), None)
    if suffix is None:
        return None
    return model.get_buffer(f"{name.removesuffix(suffix)}.self_attn.{KV_SCALE_SUFFIXES[suffix]}")


def read_safetensors(model_dir: Path, device: torch.device) -> Iterator[tuple[str, CheckpointTensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device=str(device)) as f:
            for name in f.keys():
                part = f.get_slice(name)
                yield name, CheckpointTensor(tuple(part.get_shape()),
                                             lambda index, f=f, name=name, part=part:
                                             f.get_tensor(name) if index is None else part[index])


def checkpoint_targets(model: nn.Module) -> dict[str, Target | None]:
    """Checkpoint tensor name -> the Target it fills, or None for a tensor this rank skips (a
    row-parallel bias off rank 0).

    A module with `shards` (a fused projection) takes several checkpoint tensors stacked along
    dim 0, e.g. `self_attn.q_proj.weight` into rows [0, q_size) of `self_attn.qkv_proj.weight`.
    A module with `tp_split` (dim, rank, parts) holds the rank's slice of each of its tensors
    along dim, of those that have that dim.

    A module with `expert_shards` (a mixture of experts' stacked weights) takes each expert's
    tensors, `<module>.{e}.<shard>.weight` (and `.weight_scale`, FP8), into param[e] (see
    layers.moe.FusedExperts)."""
    targets = {}
    for module_name, module in model.named_modules():
        shards = getattr(module, "shards", None)
        dim, rank, parts = getattr(module, "tp_split", (0, 0, 1))
        parent = module_name.rpartition(".")[0]
        if hasattr(module, "expert_shards"):
            targets.update(_expert_targets(module_name, module, rank, parts))
            continue
        for param_name, param in module.named_parameters(recurse=False):
            split = (dim, rank, parts) if param.dim() > dim else (0, 0, 1)
            if shards is None:
                targets[_join(module_name, param_name)] = Target(param, 0, param.shape[0], *split)
                continue
            for shard, (start, size) in shards.items():
                targets[_join(parent, shard, param_name)] = Target(param, start, size, *split)
        for param_name in getattr(module, "skipped", ()):
            targets[_join(module_name, param_name)] = None
    return targets


def _expert_targets(module_name: str, module: nn.Module, rank: int, parts: int) -> dict[str, Target]:
    targets = {}
    for shard, (param_name, start, size, dim) in module.expert_shards.items():
        for suffix, name in (("weight", param_name), ("weight_scale", f"{param_name}_scale")):
            param = getattr(module, name, None)
            for expert in range(0 if param is None else param.shape[0]):
                targets[_join(module_name, str(expert), shard, suffix)] = Target(
                    param, start, size, dim, rank, parts, expert)
    return targets


def fused_tensors(model: nn.Module) -> dict[str, list[str]]:
    """The checkpoint name of each fused projection's own tensor (Phi-3's
    `self_attn.qkv_proj.weight`, `mlp.gate_up_proj.weight`) -> the shard names it stacks, in
    the order it stacks them."""
    fused = {}
    for module_name, module in model.named_modules():
        if (shards := getattr(module, "shards", None)) is None:
            continue
        parent = module_name.rpartition(".")[0]
        for param_name, _ in module.named_parameters(recurse=False):
            fused[_join(module_name, param_name)] = [_join(parent, shard, param_name) for shard in shards]
    return fused


def _unfuse(name: str, tensor: CheckpointTensor, shard_names: list[str] | None,
            targets: dict[str, Target | None]) -> Iterator[tuple[str, CheckpointTensor]]:
    """A fused checkpoint tensor as the shard tensors it stacks along dim 0 (each a view that
    reads its own rows: a rank's slice of a fused qkv is its q rows, its k rows and its v rows);
    any other tensor as it is. A per-tensor weight scale applies to every shard."""
    if shard_names is None:
        yield name, tensor
        return
    if name.endswith(SCALE_SUFFIX) and math.prod(tensor.shape) == 1:
        yield from ((shard, tensor) for shard in shard_names)
        return
    sizes = [targets[shard].size * targets[shard].parts for shard in shard_names]
    if tensor.shape[:1] != (sum(sizes),):
        raise ValueError(f"checkpoint tensor {name} has shape {tensor.shape} but the model expects "
                         f"{sum(sizes)} rows ({' + '.join(map(str, sizes))}); does the model's "
                         "config match its weights?")
    for shard, begin, size in zip(shard_names, itertools.accumulate(sizes, initial=0), sizes):
        yield shard, CheckpointTensor((size, *tensor.shape[1:]),
                                      lambda index, begin=begin, size=size: tensor.read(_rows(index, begin, size)))


def _rows(index: Index, begin: int, size: int) -> tuple[slice, ...]:
    """`index` into rows [begin, begin + size) of a tensor, as an index into the whole tensor."""
    if index is None:
        return (slice(begin, begin + size),)
    start, stop, _ = index[0].indices(size)
    return (slice(begin + start, begin + stop), *index[1:])


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted(_shard(index, name) for name in set(weight_map.values()))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: download the safetensors "
                                "weights, or pass --load-format dummy for random weights")
    return files


def _shard(index: Path, name: object) -> Path:
    """The file a safetensors index names, which must be in the model's folder or below: `..` or an
    absolute path would read outside it. Checked by name, not resolved: Hugging Face's cache links
    each shard to a blob outside its snapshot folder."""
    path = Path(name) if isinstance(name, str) else None
    if path is None or path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"{index}: weight_map names the shard {name!r}, which is not a file in the model's "
                         "folder; the index is corrupt or crafted")
    return index.parent / path


def _copy(name: str, tensor: CheckpointTensor, target: Target) -> None:
    if name.endswith(SCALE_SUFFIX):
        _copy_scale(name, tensor, target)
        return
    if tensor.shape != target.checkpoint_shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tensor.shape} but the model "
                         f"expects {target.checkpoint_shape}; does the model's config match its weights?")
    value = tensor.read(target.index())
    if target.param.dtype == FP8_DTYPE and value.dtype != FP8_DTYPE:
        raise ValueError(f"checkpoint tensor {name} is {value.dtype}, not FP8 E4M3 as config.json's "
                         "quantization_config says; remove that quantization_config (pass "
                         "--quantization fp8 to quantize at load) or use the FP8 export")
    target.view.copy_(value)


def _copy_scale(name: str, tensor: CheckpointTensor, target: Target) -> None:
    """A weight scale, read whole (it is small): per tensor ([] or [1]) or per channel ([N] or
    [N, 1]). A fused projection's per-tensor shard scales become per-channel scales of its rows,
    which is exact; a column-parallel rank takes its channels, a row-parallel one all of them."""
    value = tensor.read(None).reshape(-1, 1)
    if value.shape[0] == 1:
        value = value.expand(target.size, 1)
    elif target.dim == 0 and target.parts > 1:
        value = value[target.rank * target.size:(target.rank + 1) * target.size]
    if value.shape != target.view.shape:
        raise ValueError(f"checkpoint tensor {name} has {tensor.shape} scales but the model expects "
                         f"{target.size * target.parts} channels; does the model's config match its weights?")
    target.view.copy_(value)


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:5])
    return f"{len(names)} tensors ({shown}{', ...' if len(names) > 5 else ''})"
