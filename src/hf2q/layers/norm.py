"""RMSNorm. GGUF norm weights already hold Qwen's `1 + gamma`, so the weight multiplies plainly."""
from __future__ import annotations

import torch
from torch import nn

from hf2q.kernels.norm.reference import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
