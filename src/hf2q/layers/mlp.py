"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""
from __future__ import annotations

import torch
from torch import nn

from hf2q.kernels.linear import ops as linear_ops
from hf2q.kernels.quant.ops import int8_reader
from hf2q.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate = Linear(hidden, intermediate)
        self.up = Linear(hidden, intermediate)
        self.down = Linear(intermediate, hidden)

    @property
    def packs(self) -> tuple[tuple[Linear, ...], ...]:
        """The projections forward multiplies as one pack (linear_ops.pack)."""
        return ((self.gate, self.up),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Gate and up as one GEMM, then the SwiGLU (linear_ops.packed_swiglu: at one row the GEMV's epilogue,
        with int8 rows written for a quantized down projection), then down."""
        (act,) = linear_ops.packed_swiglu(x, (self.gate, self.up), int8_reader(x, self.down.qtype))
        return self.down(act)
