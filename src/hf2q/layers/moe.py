"""Sparse MoE: softmax router, top-k with renormalised probabilities, SwiGLU experts, gated shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf2q.layers.linear import Linear
from hf2q.layers.mlp import MLP


class MoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, expert_dim: int, shared_dim: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = Linear(hidden, num_experts)
        # Stacked expert weights: [experts, out, in]
        self.gate_exps = nn.Parameter(torch.empty(num_experts, expert_dim, hidden), requires_grad=False)
        self.up_exps = nn.Parameter(torch.empty(num_experts, expert_dim, hidden), requires_grad=False)
        self.down_exps = nn.Parameter(torch.empty(num_experts, hidden, expert_dim), requires_grad=False)
        self.shared = MLP(hidden, shared_dim) if shared_dim else None
        self.shared_gate = Linear(hidden, 1) if shared_dim else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            rows, slot = torch.where(experts == e)
            h = x[rows]
            y = F.linear(F.silu(F.linear(h, self.gate_exps[e])) * F.linear(h, self.up_exps[e]), self.down_exps[e])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out
