"""LoRA adapters: the --lora-modules given at start (Hugging Face PEFT directories), all held on
the host, up to --max-loras of them at once in device slots that the decoder's projections read.

Each adapted projection keeps every slot's A and B stacked: a [S * n * r, K] and b [N, S * n * r]
for S slots, the n checkpoint projections it fuses (qkv_proj's q, k and v) and r = --max-lora-rank,
zero past an adapter's own rank and for what it does not target, the scaling folded into b. A
step's per-token slot (-1: the base model) goes into a persistent buffer, so that a CUDA graph's
replay reads each step's, and each token's delta (x @ a_s.T) @ b_s.T of its slot s is added to the
projection's output: on a GPU by kernels/lora.py, on the CPU through a one-hot mask [rows, S]
(kernels/reference.py's lora_delta_ref, where every token pays for every slot's rank)."""
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from pagedserve.common.config import EngineConfig
from pagedserve.executor_svc.layers.decoder import CausalLM
from pagedserve.executor_svc.layers.linear import FUSED_ROWS, Linear
from pagedserve.executor_svc.layers.mlp import GatedMLP
from pagedserve.kernels.lora import add_lora
from pagedserve.kernels.reference import lora_delta_ref

# The checkpoint projections an adapter may adapt, and the fused ones of checkpoints that fuse them
# (Phi-3's qkv_proj and gate_up_proj), which its adapters target whole.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "gate_up_proj")
# PEFT's names of a decoder layer's LoRA tensors (Gemma 3's text model under language_model).
TENSOR = re.compile(r"base_model\.model\.(?:model\.(?:language_model\.)?|language_model\.model\.)"
                    r"layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight")
# adapter_config.json keys for what this version does not apply, refused where set.
UNBUILT = {"use_dora": "DoRA (use_dora)", "lora_bias": "LoRA biases (lora_bias)",
           "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
           "modules_to_save": "fully trained modules (modules_to_save)"}


@dataclass(slots=True)
class Target:
    """Where a checkpoint projection's LoRA lands: its block of `module`'s slot columns, and its
    output rows [start, start + size)."""
    module: Linear
    block: int
    start: int
    size: int


@dataclass(slots=True)
class Adapter:
    """One adapter's weights on the host: (target, A [r, K], B [size, r]), and its scaling."""
    name: str
    scaling: float
    weights: list[tuple[Target, torch.Tensor, torch.Tensor]]


def parse_lora_modules(config: EngineConfig) -> dict[str, str]:
    """--lora-modules as adapter name -> directory, in the order given."""
    if config.lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora: add it, or drop --lora-modules")
    modules: dict[str, str] = {}
    for entry in config.lora_modules or []:
        name, path = _parse_entry(entry)
        if name in modules:
            raise ValueError(f"--lora-modules names the adapter {name!r} twice: give each adapter a name of its own")
        modules[name] = path
    return modules


def _parse_entry(entry: str) -> tuple[str, str]:
    if entry.lstrip().startswith("{"):
        try:
            fields = json.loads(entry)
        except json.JSONDecodeError:
            fields = None
        name, path = (fields.get("name"), fields.get("path")) if isinstance(fields, dict) else (None, None)
    else:
        name, _, path = entry.partition("=")
    if not (isinstance(name, str) and isinstance(path, str) and name and path):
        raise ValueError(f"--lora-modules entry {entry!r} is neither NAME=PATH nor a JSON object with "
                         "\"name\" and \"path\": write it as one of those")
    return name, path


def check_engine(config: EngineConfig, runner: str, quantization: str | None) -> None:
    """Refuses, with --enable-lora, what this version does not serve adapters with."""
    if not config.enable_lora:
        return
    if config.tensor_parallel_size > 1:
        raise ValueError("--enable-lora serves adapters on one GPU: drop --tensor-parallel-size (-tp)")
    if quantization:
        raise ValueError(f"--enable-lora applies adapters to model-dtype weights, not {quantization} ones: "
                         "drop --quantization or serve an unquantized checkpoint")
    if runner == "pooling":
        raise ValueError("--enable-lora serves generation: drop --runner pooling or --enable-lora")


def load_adapters(modules: dict[str, str], model: nn.Module, max_rank: int) -> list[Adapter]:
    """Every adapter of `modules` (name -> PEFT directory), checked against the model's shapes;
    refuses a model this version does not serve adapters on, even without any."""
    targets = model_targets(model)
    return [load_adapter(name, Path(path), targets, max_rank) for name, path in modules.items()]


def model_targets(model: nn.Module) -> list[dict[str, Target]]:
    """Each decoder layer's projections by checkpoint name ("self_attn.q_proj", and a fused one's
    own name too); refuses a model whose layers are not attention then a gated MLP of Linears."""
    layers = model.model.layers if isinstance(model, CausalLM) else []
    if not layers or not all(isinstance(layer.mlp, GatedMLP) for layer in layers):
        raise ValueError(f"--enable-lora serves dense decoder models (Llama, Qwen, Mistral, Phi-3, Gemma), "
                         f"not {model.config.architecture}'s mixture-of-experts layers: drop --enable-lora")
    return [_layer_targets(layer) for layer in layers]


def _layer_targets(layer: nn.Module) -> dict[str, Target]:
    targets = {}
    for path, module in layer.named_modules():
        if not isinstance(module, Linear):
            continue
        parent, _, leaf = path.rpartition(".")
        shards = getattr(module, "shards", {leaf: (0, module.out_features)})
        for block, (shard, (start, size)) in enumerate(shards.items()):
            targets[f"{parent}.{shard}"] = Target(module, block, start, size)
        targets[path] = Target(module, 0, 0, module.out_features)
    return targets


def load_adapter(name: str, path: Path, targets: list[dict[str, Target]], max_rank: int) -> Adapter:
    """The PEFT adapter in `path`: adapter_config.json and adapter_model.safetensors (or .bin)."""
    config = _read_config(name, path)
    rank = config.get("r", 8)
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, more than --max-lora-rank {max_rank}: "
                         f"raise --max-lora-rank to {rank} or more")
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(name, path).items():
        match = TENSOR.fullmatch(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r} has the tensor {key}, which is no A or B of a decoder "
                             f"layer's projection (embedding and lm_head LoRA are not built): remove it")
        pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor
    weights = [_weight(name, targets, layer, module, pair, rank) for (layer, module), pair in pairs.items()]
    return Adapter(name, scaling, weights)


def _read_config(name: str, path: Path) -> dict:
    file = path / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {file} does not exist; pass a PEFT adapter directory")
    config = json.loads(file.read_text())
    unbuilt = [what for key, what in UNBUILT.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        unbuilt.append(f"biases (bias={config['bias']!r})")
    if config.get("peft_type", "LORA") != "LORA":
        unbuilt.append(f"peft_type {config['peft_type']!r}")
    targeted = config.get("target_modules") or []
    if isinstance(targeted, list):
        unbuilt += [f"target module {m!r}" for m in targeted if m not in TARGETS + FUSED_TARGETS]
    if unbuilt:
        raise ValueError(f"LoRA adapter {name!r} uses {', '.join(unbuilt)}, which pagedserve does not apply: "
                         f"serve an adapter of plain LoRA on {', '.join(TARGETS)}")
    return config


def _read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    if (path / "adapter_model.safetensors").is_file():
        return load_file(path / "adapter_model.safetensors")
    if (path / "adapter_model.bin").is_file():
        return torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {name!r}: {path} holds no adapter_model.safetensors (nor .bin); "
                     "pass a PEFT adapter directory")


def _weight(name: str, targets: list[dict[str, Target]], layer: int, module: str,
            pair: dict[str, torch.Tensor], rank: int) -> tuple[Target, torch.Tensor, torch.Tensor]:
    target = targets[layer].get(module) if layer < len(targets) else None
    where = f"layers.{layer}.{module}"
    if target is None:
        raise ValueError(f"LoRA adapter {name!r} adapts {where}, a projection this model does not have: "
                         "serve it with the model it was trained on")
    a, b = pair.get("A"), pair.get("B")
    shapes = (rank, target.module.in_features), (target.size, rank)
    if a is None or b is None or (tuple(a.shape), tuple(b.shape)) != shapes:
        found = [None if t is None else tuple(t.shape) for t in (a, b)]
        raise ValueError(f"LoRA adapter {name!r}: {where}'s lora_A and lora_B are {found}, not {list(shapes)} "
                         "as its rank and the model's shapes make them: serve it with the model it was trained on")
    return target, a, b


@dataclass(slots=True)
class LoraSwitch:
    """Whether the step running now has a token with an adapter: without one the projections skip
    their LoRA delta, and a graph replay takes the graphs captured without it (cuda_graphs.py)."""
    on: bool = True


class LoraSlots:
    """The adapters on the host and their device slots: wraps each adapted projection's forward,
    holds every batch row's slot (`row_slots`, -1: none), and fills the step's per-token mask."""

    def __init__(self, model: nn.Module, adapters: list[Adapter], max_loras: int, max_rank: int,
                 max_rows: int, max_seqs: int, dtype: torch.dtype, device: torch.device) -> None:
        self.adapters = {adapter.name: adapter for adapter in adapters}
        self.slot_names: list[str | None] = [None] * max_loras
        self.row_slots = np.full(max_seqs, -1, dtype=np.int64)
        # The projections' padding rows (layers/linear.py's input_rows) read the mask too.
        rows = max(max_rows, FUSED_ROWS)
        self.token_slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        # The CPU's form of the slots; a GPU's kernel reads token_slots itself.
        self.mask = None if device.type == "cuda" else torch.zeros(rows, max_loras, dtype=dtype, device=device)
        # What each token's slot is compared with to fill the mask, made once rather than each step.
        self.slot_ids = None if self.mask is None else torch.arange(max_loras, device=device)
        self.switch = LoraSwitch()
        modules = list(dict.fromkeys(t.module for adapter in adapters for t, _, _ in adapter.weights))
        self.projections = [_wrap(m, max_loras, max_rank, dtype, self.token_slots, self.mask, self.switch)
                            for m in modules]
        # Each adapter's slot of every projection, laid out on the host once (None: not adapted).
        self.blocks = {adapter.name: [_slot_block(adapter, m, max_rank, dtype) for m in modules]
                       for adapter in adapters}

    def assign(self, row: int, name: str, live_rows: Iterable[int]) -> None:
        """Gives the batch row the slot of adapter `name` ("" for none), loading it into a slot
        that no other live row uses if no slot holds it."""
        self.row_slots[row] = -1
        if not name:
            return
        if name not in self.adapters:
            raise ValueError(f"step plan asks for the LoRA adapter {name!r}, which this executor does not "
                             f"serve ({sorted(self.adapters)}); the scheduler and executor are out of step")
        if name not in self.slot_names:
            self._load(self._free_slot(live_rows), name)
        self.row_slots[row] = self.slot_names.index(name)

    def _free_slot(self, live_rows: Iterable[int]) -> int:
        used = set(self.row_slots[list(live_rows)].tolist())
        free = [slot for slot in range(len(self.slot_names)) if slot not in used]
        if not free:
            raise ValueError(f"step plan runs more than --max-loras ({len(self.slot_names)}) adapters at once; "
                             "the scheduler must keep to ExecutorInfo.max_loras")
        # An empty slot first: the others hold adapters that a later request may ask for again.
        return next((slot for slot in free if self.slot_names[slot] is None), free[0])

    def _load(self, slot: int, name: str) -> None:
        # In place: CUDA graphs hold the slots' addresses. Queued behind the steps in flight, which
        # may still read the adapter this replaces.
        for projection, block in zip(self.projections, self.blocks[name]):
            width = len(projection.a) // len(self.slot_names)
            a, b = projection.a[slot * width:(slot + 1) * width], projection.b[:, slot * width:(slot + 1) * width]
            if block is None:
                a.zero_()
                b.zero_()
            else:
                a.copy_(block[0])
                b.copy_(block[1])
        self.slot_names[slot] = name

    def upload(self, rows: np.ndarray, query_lens: np.ndarray, upload: Callable) -> None:
        """Sets the switch, and for a step with an adapter fills its mask: query_lens tokens of each
        batch row, then padding (no adapter)."""
        slots = self.row_slots[rows]
        self.switch.on = bool((slots >= 0).any())
        if not self.switch.on:
            # Such a step's projections and graphs skip the deltas and read no mask.
            return
        num_tokens = int(query_lens.sum())
        upload(np.repeat(slots, query_lens), self.token_slots[:num_tokens])
        self.token_slots[num_tokens:].fill_(-1)
        if self.mask is not None:
            self.mask.copy_(self.token_slots[:, None] == self.slot_ids)


@dataclass(slots=True)
class LoraProjection:
    """A projection's S slots: a [S * n * r, K], b [N, S * n * r]; the step's slot of each token, the
    CPU's one-hot mask of them [rows, S] (None on a GPU), and whether the step has an adapter at all."""
    a: torch.Tensor
    b: torch.Tensor
    token_slots: torch.Tensor
    mask: torch.Tensor | None
    switch: LoraSwitch
    num_slots: int


def _wrap(module: Linear, slots: int, rank: int, dtype: torch.dtype, token_slots: torch.Tensor,
          mask: torch.Tensor | None, switch: LoraSwitch) -> LoraProjection:
    width = slots * _num_shards(module) * rank
    device = module.weight.device
    # The model's dtype, not a narrowed weight's (layers/linear.py's narrow_linears).
    projection = LoraProjection(torch.zeros(width, module.in_features, dtype=dtype, device=device),
                                torch.zeros(module.out_features, width, dtype=dtype, device=device),
                                token_slots, mask, switch, slots)
    module.forward = partial(_lora_forward, module.forward, projection)
    return projection


def _lora_forward(base: Callable, lora: LoraProjection, x: torch.Tensor) -> torch.Tensor:
    out = base(x)
    if not lora.switch.on:
        return out
    # In place: the projection's output is its own, fresh tensor.
    if lora.mask is None:
        return add_lora(out, x, lora.a, lora.b, lora.token_slots, lora.num_slots)
    return lora_delta_ref(out, x, lora.a, lora.b, lora.mask)


def _num_shards(module: Linear) -> int:
    """The checkpoint projections a module fuses (qkv_proj's three), each a block of a slot's columns."""
    return len(getattr(module, "shards", (None,)))


def _slot_block(adapter: Adapter, module: Linear, rank: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a, b) of one slot of `module` for `adapter`: its A rows and scaled B columns in each
    target's block; None where the adapter does not adapt the module."""
    weights = [(t, a, b) for t, a, b in adapter.weights if t.module is module]
    if not weights:
        return None
    blocks = _num_shards(module)
    a_slot = torch.zeros(blocks * rank, module.in_features)
    b_slot = torch.zeros(module.out_features, blocks * rank)
    for target, a, b in weights:
        cols = slice(target.block * rank, target.block * rank + len(a))
        if a_slot[cols].any():
            raise ValueError(f"LoRA adapter {adapter.name!r} adapts a fused projection both whole and by "
                             "its parts: keep one of them")
        a_slot[cols] = a.float()
        b_slot[target.start:target.start + target.size, cols] = b.float() * adapter.scaling
    return a_slot.to(dtype), b_slot.to(dtype)
