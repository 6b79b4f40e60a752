"""Residual add + RMSNorm and the DeltaNet's gated RMSNorm: picks the Triton kernel or the reference."""
from __future__ import annotations

import torch

from hf2q.kernels.choose import kernels_on
from hf2q.kernels.norm import reference
from hf2q.kernels.norm.reference import rms_norm


def add_rms_norm(x: torch.Tensor, add, weight: torch.Tensor, eps: float,
                 int8_for: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + add, rms_norm(x + add)): the new residual and the block input; add None: (x, rms_norm(x)).
    int8_for: the block input feeds the int8 mat-vec of a weight of that type (quant_ops.int8_reader); the
    kernel also writes its int8 rows."""
    if kernels_on(x) and x.dim() == 2 and x.stride(1) == 1 and (add is None or add.stride(1) == 1):
        from hf2q.kernels.norm.add_rms_triton import add_rms_norm as kernel
        return kernel(x, add, weight, eps, int8_for)
    if add is not None:
        x = x + add
    return x, rms_norm(x, weight, eps)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """Per-head rms_norm(o) * weight * silu(z) of the DeltaNet output: o [T, H, D], z [T, H * D]
    -> [T, H * D] in out_dtype."""
    if kernels_on(o) and o.stride(2) == 1 and z.stride(1) == 1:
        from hf2q.kernels.norm.gated_triton import gated_rms_norm as kernel
        return kernel(o, z, weight, eps, out_dtype)
    return reference.gated_rms_norm(o, z, weight, eps, out_dtype)
