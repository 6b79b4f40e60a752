"""Gated DeltaNet kernels, reference versions: the exact CPU path and the oracle for fast kernels.

Shapes are for one sequence: n tokens, h value heads (q/k already expanded to h heads).
"""
from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / ‖x‖ over the last axis (the DeltaNet's q and k per head), eps inside the root."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor, capture: bool = False,
                         store_dtype: torch.dtype = torch.float32):
    """Delta rule with decay, token by token (post-decay form, as llama.cpp and fla's recurrent kernel).

    q, k: [n, h, dk] (q pre-scaled); v: [n, h, dv]; g: [n, h] log-decay; beta: [n, h];
    state: [h, dk, dv]. Returns (o [n, h, dv], final state, per-token states [n, h, dk, dv] or None), states fp32.
    The arithmetic is fp32; store_dtype: the dtype a slot keeps its state in, the state rounded to it after each
    token's read-out, as a decode step stores it, so every later token starts from what a slot would hold.
    """
    s = state.float().clone()
    qf, kf, vf = q.float(), k.float(), v.float()
    decay, bf = g.float().exp(), beta.float()
    out = torch.empty_like(vf)
    states = torch.empty((q.shape[0],) + tuple(s.shape), dtype=s.dtype, device=s.device) if capture else None
    for t in range(q.shape[0]):
        s = s * decay[t][:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", s, kf[t])
        delta = (vf[t] - kv_mem) * bf[t][:, None]
        s = s + kf[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, qf[t])
        if store_dtype != torch.float32:
            s = s.to(store_dtype).float()
        if states is not None:
            states[t] = s
    return out.to(v.dtype), s, states
