"""Sparse-MoE routing, expert loop and combine in torch: the exact CPU path (layers/moe.py) and the oracle
of the routing, expert and combine kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] renormalised over the top k, in dtype; experts [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(dtype), experts


def expert_pairs(x: torch.Tensor, experts: torch.Tensor, gate_exps: torch.Tensor, up_exps: torch.Tensor,
                 down_exps: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert_k(x) of every token-expert pair [T·k, H] (pair p: token p // k, its (p % k)-th expert),
    one loop step per chosen expert; stacks [E, out, in]."""
    t, top_k = experts.shape
    pairs = torch.empty(t * top_k, down_exps.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == e)
        h = F.silu(F.linear(x[rows], gate_exps[e])) * F.linear(x[rows], up_exps[e])
        pairs[rows * top_k + slot] = F.linear(h, down_exps[e])
    return pairs


def combine(pairs: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
            shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k weights · pairs (pair outputs [T·k, H]) plus sigmoid(shared_gate) · shared when given."""
    t, top_k = weights.shape
    out = (pairs.view(t, top_k, -1) * weights[..., None].to(pairs.dtype)).sum(1)
    return out if shared is None else out + torch.sigmoid(shared_gate) * shared
