"""Which device and dtype the executor runs on, from --device and --dtype."""
import os
from contextlib import contextmanager

import torch

from pagedserve.common.cpus import usable_cpus
from pagedserve.executor_svc.model_config import ModelConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but torch sees no CUDA GPU; use --device cpu")
    return device


def cap_cpu_threads() -> None:
    """Sizes torch's CPU threads to the CPUs this process may use, quota included, unless
    OMP_NUM_THREADS chose them."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(torch.get_num_threads(), usable_cpus()))


def device_broken(error: BaseException) -> bool:
    """Whether `error` leaves the device unusable for the rest of the process: a CUDA error (a
    device-side assert, an illegal address) fails every later call too, unlike running out of
    memory. torch raises AcceleratorError for them since 2.8, a RuntimeError naming them before."""
    kind = getattr(torch, "AcceleratorError", RuntimeError)
    return isinstance(error, kind) and (kind is not RuntimeError or "CUDA error" in str(error))


def resolve_dtype(name: str, model: ModelConfig, device: torch.device,
                  quantization: str | None = None) -> torch.dtype:
    """`auto`: float32 on the CPU, the checkpoint's dtype (bfloat16 when unstated) on a GPU, and
    bfloat16 there when quantized (the FP8 GEMM writes bfloat16)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    if quantization:
        return torch.bfloat16
    return getattr(torch, model.dtype or "bfloat16")


def resolve_linear_dtype(name: str, model: ModelConfig, device: torch.device, dtype: torch.dtype,
                         quantization: str | None = None) -> torch.dtype:
    """The dtype of the decoder's linear weights: the model dtype, except under `--dtype auto` on
    a CPU that computes in bfloat16 natively (AVX512-BF16 or AMX), for a checkpoint that is
    neither float32 nor quantized (a GGUF of quantized blocks counts as float16). There the
    projections keep bfloat16 weights under float32 activations: a decode step reads its weights
    once, and half the bytes make it nearly twice as fast, while the residual stream, norms,
    attention and KV cache stay float32 (whole-bfloat16 activations changed the default model's
    greedy answers far more often). There layers/linear.py also keeps weights on a 4-bit grid as
    their codes, and the worker gives the LM head narrow copies (int8 at few rows, bfloat16 at
    more) corrected to float32 near each row's greatest logit (NarrowHead)."""
    narrow = (name == "auto" and device.type == "cpu" and dtype == torch.float32
              and cpu_computes_bf16() and model.dtype != "float32" and not quantization)
    return torch.bfloat16 if narrow else dtype


def cpu_computes_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX); oneDNN's bfloat16
    inner product needs it or AVX-512 (an AVX2-only CPU refuses the layout)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
