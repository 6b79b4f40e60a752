"""RMSNorm and the DeltaNet's gated RMSNorm in torch: the exact CPU path of the norm kernels and their test
oracle (layers/norm.py and layers/gdn.py use them)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """Per-head rms_norm(o) * weight * silu(z) of the DeltaNet output: o [T, H, D], z [T, H * D] (or
    [T, H, D]) -> [T, H * D] in out_dtype."""
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    of = of * F.silu(z.float().reshape(o.shape))
    return of.to(out_dtype).reshape(o.shape[0], -1)
