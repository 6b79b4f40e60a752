"""Rejection sampling of a draft token: the emitted token is distributed as the target's, whatever q is.

Draft d was drawn from the proposer's distribution q, the target's distribution at that position is p.
Keep d with probability min(1, p(d) / q(d)); otherwise draw from norm(max(0, p - q)). Then
P(token = x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) * max(0, p(x) - q(x)) / Z = p(x).

A deterministic proposer (n-gram, greedy MTP) has q one-hot at d: keep d with probability p(d), else draw
from p without d. `Engine._verify` realises exactly that case by drawing the row's token from p with the
request's own generator, as a plain decode step would, and keeping the draft when they agree: the same
distribution, and with a request seed the same tokens as without speculation.
"""
from __future__ import annotations

from typing import Optional

import torch


def accept_or_resample(p: torch.Tensor, draft: int, q: Optional[torch.Tensor] = None,
                       generator: Optional[torch.Generator] = None) -> tuple[int, bool]:
    """(token, kept): the draft if kept, else a draw from the residual. p, q: [V] probabilities (q None:
    one-hot at `draft`, a deterministic proposer)."""
    p = p.float()
    if q is None:
        q = torch.zeros_like(p)
        q[draft] = 1.0
    q = q.float().to(p.device)
    if not q[draft] > 0:
        raise ValueError(f"draft {draft} has probability 0 under its own proposal")
    ratio = float(p[draft] / q[draft])
    u = float(torch.rand((), generator=generator, device=p.device if generator is None else generator.device))
    if u < min(1.0, ratio):
        return draft, True
    residual = (p - q).clamp_min_(0)
    total = float(residual.sum())
    if total <= 0:  # p == q: a rejection has probability 0, only rounding reaches here
        residual, total = p, float(p.sum())
    token = torch.multinomial(residual / total, 1, generator=generator)
    return int(token), False
