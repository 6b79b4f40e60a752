"""The SwiGLU activation: picks the Triton kernel (which can also write the int8 rows the next quantized
projection reads) or torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hf2q.kernels.choose import kernels_on


def silu_mul(gate: torch.Tensor, up: torch.Tensor, int8_for: str | None = None) -> torch.Tensor:
    """SwiGLU activation silu(gate) * up. int8_for: the result feeds the int8 mat-vec of a weight of that
    type; the kernel also writes its int8 rows."""
    if kernels_on(gate) and gate.stride(-1) == 1 and up.stride(-1) == 1:
        from hf2q.kernels.activation.swiglu_triton import silu_mul as kernel
        return kernel(gate, up, int8_for)
    return F.silu(gate) * up
