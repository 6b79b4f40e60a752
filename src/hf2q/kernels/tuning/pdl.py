"""Programmatic dependent launch (Hopper and later): the decode step's kernels overlap their neighbours.

A decode step is some 300 short kernels, each of a few microseconds, most of them mat-vecs whose
weights depend on nothing the step computes. Launched normally, a kernel starts only once the one
before it has finished and its writes are flushed, so every launch pays the start-up and the first
memory round trip with the memory idle. Launched with programmatic dependent launch (`launch_pdl`), a
kernel's programs may start as soon as every program of the kernel before it has signalled
(`release_next`) or exited, and wait (`wait_prior`) before they read anything the step computed: the
start-up of one kernel overlaps the end of the one before it.

The rule that keeps this exact: a kernel launched this way reads no activation, routing table or
cache, and writes nothing, before `wait_prior`; it returns only after the kernel before it has
finished with every write visible, so the order of the stream is kept transitively. A kernel launched
the ordinary way waits for its predecessor to finish as before, so kernels can take part one by one.

HF2Q_PDL: 1 (default; used on CUDA devices of compute capability 9 or more) launches the decode kernels
so; 0 launches them normally. (Asking for a mat-vec's weights into L2 before its wait was measured slower:
BENCHMARKS.md.)
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hf2q import envs

try:  # Triton's grid dependency control; absent in builds without it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAVE_GDC = True
except ImportError:  # pragma: no cover - Triton builds before 3.4
    _HAVE_GDC = False

_SETTING = envs.pdl()
_INTERPRETED = envs.triton_interpret()  # the interpreter has no grid dependency control


@functools.lru_cache(maxsize=None)
def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (see HF2Q_PDL)."""
    if not _SETTING or _INTERPRETED or not _HAVE_GDC or device.type != "cuda" or torch.version.hip:
        return False  # griddepcontrol is NVIDIA's (a ROCm build also answers to "cuda")
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """Launch keywords and the PDL constexpr for a kernel that calls wait_prior(PDL) before its reads; none
    where PDL is off (the kernels' PDL defaults to False, and Triton builds without `launch_pdl` take no
    such keyword)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible (with PDL)."""
    if PDL:
        gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel's programs start (with PDL): once every program of this one has called it."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def enter(PDL: tl.constexpr):
    """The start of a short kernel (one wave of programs): let the next kernel's programs start at once,
    then wait for the previous kernel."""
    release_next(PDL)
    wait_prior(PDL)
