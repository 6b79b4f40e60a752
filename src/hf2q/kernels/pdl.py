"""Programmatic dependent launch (Hopper and later): overlap a decode step's kernel boundaries.

A batch-1 decode step is a few hundred short kernels in a row, and each normally starts only after the one
before it has finished and flushed. A kernel launched with `launch_pdl` may start as soon as every program
of the one before it has signalled (`gdc_launch_dependents`, or exited); it then reads its weights, which
no step ever writes, and waits (`gdc_wait`, which returns once the previous kernel has completed and its
writes are visible) before it reads an activation or writes anything. The mat-vecs are launched this way,
and the kernels that feed them (norms, SwiGLU, activation quantizing) signal at their start.

HF2Q_PDL=1 turns it on (CUDA devices of compute capability 9.0 and later); 0, the default, launches
every kernel plainly.
"""
from __future__ import annotations

import functools
import os

import torch

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: nothing is launched this way
    gdc_launch_dependents = gdc_wait = None

_SETTING = os.environ.get("HF2Q_PDL") or "0"
if _SETTING not in ("0", "1"):
    raise ValueError(f"HF2Q_PDL must be 0 or 1, not {_SETTING!r}")


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with programmatic dependent launch."""
    return _SETTING == "1" and gdc_wait is not None and device.type == "cuda" and _capable(device.index or 0)


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a Triton launch of a kernel that waits (gdc_wait) before its first dependent access."""
    return {"launch_pdl": True} if enabled(device) else {}
