"""The emitted token's distribution under speculation is the target's: a chi-square goodness-of-fit test
over many seeded draws on a small vocabulary, and a deliberately biased acceptance that the same test
catches (so the test can fail)."""
from __future__ import annotations

import pytest
import torch

from hf2q.spec.acceptance import accept_or_resample

DRAWS = 20000
P_MIN = 1e-3  # fits at p > 1e-3 pass; the biased control must land far below


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square statistic with len - 1 degrees of freedom."""
    expected = probs.double() * counts.sum()
    stat = float(((counts.double() - expected) ** 2 / expected).sum())
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def emitted(p, q, sample_draft, accept=accept_or_resample, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.numel(), dtype=torch.long)
    for _ in range(DRAWS):
        draft = sample_draft(gen)
        token, _ = accept(p, draft, q, gen)
        counts[token] += 1
    return counts


def target_and_proposal(v=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(v, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(v, generator=gen) * 1.5, -1)  # a different, sampled proposal
    return p, q


def test_sampled_proposal_gives_the_target_distribution():
    p, q = target_and_proposal()
    counts = emitted(p, q, lambda g: int(torch.multinomial(q, 1, generator=g)))
    assert chi_square_p(counts, p) > P_MIN


@pytest.mark.parametrize("draft", [0, 5])  # a likely and an unlikely token under p
def test_deterministic_proposal_gives_the_target_distribution(draft):
    p, _ = target_and_proposal()
    counts = emitted(p, None, lambda g: draft)
    assert chi_square_p(counts, p) > P_MIN


def test_a_biased_acceptance_is_caught():
    p, q = target_and_proposal()

    def too_eager(p, draft, q, gen):  # keeps drafts twice as often as it may
        token, kept = accept_or_resample(p, draft, q, gen)
        if not kept and float(torch.rand((), generator=gen)) < min(1.0, float(p[draft] / q[draft])):
            return draft, True
        return token, kept

    counts = emitted(p, q, lambda g: int(torch.multinomial(q, 1, generator=g)), accept=too_eager)
    assert chi_square_p(counts, p) < 1e-12


def test_a_draft_outside_its_own_proposal_is_refused():
    p, q = target_and_proposal()
    q[3] = 0
    with pytest.raises(ValueError, match="probability 0"):
        accept_or_resample(p, 3, q)
