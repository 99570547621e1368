"""Programmatic dependent launch (PDL, Hopper and newer) for the kernels of a decode step.

A kernel launched with `launch_pdl` is scheduled while the kernel before it in the stream is
still finishing, then waits for it (`wait_for_previous`) before it touches memory, and lets its
own successor be scheduled the same way. A batch-1 decode step is some 300 small kernels in a
row, each of which otherwise pays the launch gap. Every program of a kernel launched with PDL
calls `wait_for_previous` before it reads what the kernel before it may write, and before any
store, which keeps stream order for that memory. What no kernel of the step writes (weights,
and the step's metadata, uploaded before its first kernel) may be read before the wait: these
kernels let their successor start only after their own wait, so an early start never reaches
back past the kernel before. PAGEDSERVE_PDL=0 turns it off.
"""
import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False, "launch_pdl": False}


def launch_args(device: torch.device) -> dict[str, bool]:
    """The keyword arguments to launch a kernel with a PDL constexpr on `device`: the flag its
    wait_for_previous reads and Triton's launch_pdl, always equal. PDL is on for CUDA of compute
    capability 9.0+, off under the Triton interpreter and with PAGEDSERVE_PDL=0 (read once)."""
    return _ON if device.type == "cuda" and _enabled(device.index or 0) else _OFF


@functools.cache
def _enabled(index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("PAGEDSERVE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(index) >= (9, 0)
