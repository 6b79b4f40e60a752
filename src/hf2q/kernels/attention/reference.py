"""Causal GQA attention of a sequence's new rows over its whole prefix in torch: the exact path of the
attention layer, and what the vectorised prefill uses wherever the prefix is not only the new rows."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q: [n, nh, hd] at positions start.., k/v: [start + n, nkv, hd] -> [n, nh, hd]. Causal, GQA."""
    n, total = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    kh = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [nh, total, hd]
    vh = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    qh = q.transpose(0, 1)  # [nh, n, hd]
    mask = torch.arange(total, device=q.device)[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)
