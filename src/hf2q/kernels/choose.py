"""Which implementation of an operation runs: the one question every op's chooser asks.

Each operation has an exact torch reference and a Triton (or fla) implementation of the same contract.
The Triton side runs on CUDA tensors, and on CPU tensors while Triton's interpreter is on (its tests);
the reference runs everywhere else. The attention operations' vectorised path (packed projections, K/V
written by slot mapping, paged decode) has its own switch, `fast_path`: 'auto' takes it for CUDA tensors,
'force' on every device (its batching logic is testable on CPU), 'off' never.
"""
from __future__ import annotations

import contextlib

import torch

from hf2q import envs

_MODE = {"value": "auto"}  # auto: CUDA tensors only; off: never; force: every device


def triton_runs(x: torch.Tensor) -> bool:
    """Whether the Triton implementation can take x: a CUDA tensor, or any tensor under the interpreter."""
    return x.is_cuda or envs.triton_interpret()


def kernels_on(x: torch.Tensor) -> bool:
    """Whether a chooser of a dense operation (norms, activations, convs, rotary, the DeltaNet step, dense
    linears and experts) takes its Triton kernel for x: where Triton runs, unless `fast_path("off")` asks
    for the torch references, which the exactness tests compare against and training differentiates.
    Quantized weights have no torch path in their GPU layout: their choosers ask `triton_runs`."""
    return _MODE["value"] != "off" and triton_runs(x)


@contextlib.contextmanager
def fast_path(mode: str):
    """Temporarily set the fast-path mode: 'auto', 'off' or 'force'."""
    if mode not in ("auto", "off", "force"):
        raise ValueError(f"fast path mode must be auto, off or force, not {mode!r}")
    old, _MODE["value"] = _MODE["value"], mode
    try:
        yield
    finally:
        _MODE["value"] = old


def use_fast_path(x: torch.Tensor) -> bool:
    """Whether the attention operations take their vectorised path: on CUDA (or when forced); their exact
    per-sequence path otherwise."""
    mode = _MODE["value"]
    return mode == "force" or (mode == "auto" and x.is_cuda)
