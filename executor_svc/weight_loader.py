"""Loads a checkpoint (Hugging Face safetensors or GGUF) into the model, or fills it with dummy
weights."""
import functools
import json
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.common.log import get_logger
from pagedserve.executor_svc.fp8 import Quantize, fp8_linears, quantize_linears
from pagedserve.executor_svc.gguf_file import find_gguf, read_gguf_tensors
from pagedserve.kernels.reference import FP8_DTYPE

log = get_logger(__name__)

# Old Llama checkpoints saved the rotary inverse frequencies; the model builds its own. FP8
# checkpoints may hold static activation scales: pagedserve quantizes activations per token
# instead, a finer scale than one per tensor.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".input_scale")
SCALE_SUFFIX = ".weight_scale"
DUMMY_STD = 0.02


def load_weights(model: nn.Module, model_path: str | Path, load_format: str, seed: int = 0,
                 quantize: Quantize | None = None) -> None:
    """Fills every parameter: `auto` from the GGUF file that `model_path` names or else the
    directory's *.safetensors, `safetensors` from those only, `dummy` with seeded random values
    (norm weights 1, biases 0) without reading any weight file.

    With `quantize` (the backend's per-token FP8 quantizer) the decoder's projections run in FP8:
    an FP8 checkpoint loads as it is, any other is quantized per output channel once loaded."""
    serialized = quantize is not None and model.config.quantization == "fp8" and load_format != "dummy"
    if serialized:
        fp8_linears(model, quantize)
    _fill(model, model_path, load_format, seed)
    if quantize is not None and not serialized:
        quantize_linears(model, quantize)


def _fill(model: nn.Module, model_path: str | Path, load_format: str, seed: int) -> None:
    if load_format == "dummy":
        fill_dummy(model, seed)
    elif load_format == "auto" and (gguf_path := find_gguf(model_path)) is not None:
        load_checkpoint(model, read_gguf_tensors(gguf_path), gguf_path)
    elif load_format in ("auto", "safetensors"):
        device = next(model.parameters()).device
        load_checkpoint(model, read_safetensors(Path(model_path), device), model_path)
    else:
        raise ValueError(f"unknown --load-format {load_format!r}; use auto, safetensors or dummy")


@torch.no_grad()
def fill_dummy(model: nn.Module, seed: int) -> None:
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param.dim() == 1:
            param.zero_()
        else:
            param.normal_(0.0, DUMMY_STD, generator=generator)


@torch.no_grad()
def load_checkpoint(model: nn.Module, tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]],
                    source: str | Path) -> None:
    """Copies each (Hugging Face name, tensor reader) into the parameter slice the name maps to,
    reading one tensor at a time; every parameter must be filled and every tensor used."""
    targets = checkpoint_targets(model)
    # A tied model has no lm_head, yet some tied checkpoints still store a copy of the embeddings.
    tied = "lm_head.weight" not in targets
    loaded, unexpected = set(), []
    for name, read in tensors:
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        # The "fp8" quant_method's name for the same multiplier (w = q * scale) as weight_scale.
        name = name.removesuffix("_inv") if name.endswith(SCALE_SUFFIX + "_inv") else name
        if name not in targets:
            unexpected.append(name)
            continue
        _copy(name, read(), *targets[name])
        loaded.add(name)
    missing = sorted(targets.keys() - loaded)
    if missing or unexpected:
        raise ValueError(f"checkpoint {source} does not match {type(model).__name__}: "
                         f"missing {_few(missing)}, unexpected {_few(unexpected)}; is it a "
                         f"complete checkpoint of the architecture its config names?")
    log.info("weights_loaded", model=str(source), tensors=len(loaded))


def read_safetensors(model_dir: Path,
                     device: torch.device) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, functools.partial(f.get_tensor, name)


def checkpoint_targets(model: nn.Module) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Checkpoint tensor name -> (parameter, first row, rows) that it fills.

    A module with `shards` (a fused projection) takes several checkpoint tensors stacked along
    dim 0, e.g. `self_attn.q_proj.weight` into rows [0, q_size) of `self_attn.qkv_proj.weight`."""
    targets = {}
    for module_name, module in model.named_modules():
        shards = getattr(module, "shards", None)
        parent = module_name.rpartition(".")[0]
        for param_name, param in module.named_parameters(recurse=False):
            if shards is None:
                targets[_join(module_name, param_name)] = (param, 0, param.shape[0])
                continue
            for shard, (start, size) in shards.items():
                targets[_join(parent, shard, param_name)] = (param, start, size)
    return targets


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: download the safetensors "
                                "weights, or pass --load-format dummy for random weights")
    return files


def _copy(name: str, tensor: torch.Tensor, param: torch.Tensor, start: int, size: int) -> None:
    target = param[start:start + size]
    if name.endswith(SCALE_SUFFIX):
        # Per-tensor ([] or [1]) or per-channel ([N] or [N, 1]); a fused projection's per-tensor
        # shard scales become per-channel scales of its rows, which is exact.
        tensor = tensor.reshape(-1, 1).expand(size, 1) if tensor.numel() == 1 else tensor.reshape(-1, 1)
    if target.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
        raise ValueError(f"checkpoint tensor {name} is {tensor.dtype}, not FP8 E4M3 as config.json's "
                         "quantization_config says; remove that quantization_config (pass "
                         "--quantization fp8 to quantize at load) or use the FP8 export")
    if tensor.shape != target.shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)} but the model "
                         f"expects {tuple(target.shape)}; does the model's config match its weights?")
    target.copy_(tensor)


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:5])
    return f"{len(names)} tensors ({shown}{', ...' if len(names) > 5 else ''})"
