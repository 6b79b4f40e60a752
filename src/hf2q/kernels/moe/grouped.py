"""MoE experts as three grouped GEMMs (torch `_grouped_mm`), with no host synchronisation.

Token-expert pairs are sorted by expert; each expert multiplies its contiguous run of rows, and the
outputs go back to pair order. The caller combines them (moe/ops.moe_combine: a weighted sum over the
top-k, deterministic unlike an atomic index_add), so a CUDA graph replays exactly what eager execution
computes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_mm_available(x: torch.Tensor) -> bool:
    return hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16


def moe_expert_pairs_grouped(x: torch.Tensor, experts: torch.Tensor, gate_exps: torch.Tensor, up_exps: torch.Tensor,
                             down_exps: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; experts: [T, k]; *_exps: [E, out, in]. Returns expert_k(x) for every pair: [T·k, H], pair p
    being token p // k and its (p % k)-th expert."""
    t, top_k = experts.shape
    flat = experts.reshape(-1).long()  # the routing kernel gives int32
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gate_exps.shape[0], dtype=torch.long, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # bincount would synchronise with the host
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // top_k]
    h = F.silu(torch._grouped_mm(xs, gate_exps.transpose(1, 2), offs=offs))
    h = h * torch._grouped_mm(xs, up_exps.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(h, down_exps.transpose(1, 2), offs=offs)
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return unsorted
