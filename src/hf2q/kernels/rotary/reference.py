"""Partial NeoX rotation and the q/k preparation of attention in torch: the exact CPU path of the q/k kernel
and its test oracle (layers/rotary.py uses it)."""
from __future__ import annotations

import torch

from hf2q.kernels.norm.reference import rms_norm


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int) -> torch.Tensor:
    """x: [T, heads, head_dim], cos/sin: [T, rd]; rotates x[..., :rd], pairing (p, p + rd/2)."""
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((rot * c + rotated * s, rest), dim=-1)


def qk_norm_rope(q, k, q_w, k_w, cos, sin, eps: float, rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm, then partial RoPE, of q [T, nh, hd] and k [T, nkv, hd]."""
    return (apply_rotary(rms_norm(q, q_w, eps), cos, sin, rd), apply_rotary(rms_norm(k, k_w, eps), cos, sin, rd))
