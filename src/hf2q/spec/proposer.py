"""What a draft proposer is, and the speculation settings.

A proposer guesses the next few tokens of one request from what it has seen; the engine then checks
every guess against the target model in one forward, so a bad guess costs time, never correctness.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Protocol, Sequence

from hf2q.spec.cost import WINDOW_ROUNDS

METHODS = ("off", "ngram", "mtp", "mtp+ngram")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "off"  # one of METHODS
    num_tokens: int = 3  # drafts verified per step (k); the verify forward is k + 1 positions
    ngram_min: int = 6  # shortest suffix of the history the n-gram proposer matches
    ngram_max: int = 12  # longest suffix tried first
    max_batch: int = 8  # no request drafts while this many or more decode together
    cost_window: int = WINDOW_ROUNDS  # rounds per cost-control window (hf2q.spec.cost); 0: no cost control

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r} (choose from {', '.join(METHODS)})")
        if self.num_tokens < 1:
            raise ValueError(f"spec tokens must be at least 1, got {self.num_tokens}")
        if self.max_batch < 1:
            raise ValueError(f"spec-max-batch must be at least 1, got {self.max_batch}")
        if self.cost_window < 0:
            raise ValueError(f"spec-cost-window must be 0 (off) or more, got {self.cost_window}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= spec-ngram-min <= spec-ngram-max, got {self.ngram_min}, {self.ngram_max}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


def add_spec_args(parser) -> None:
    """`--speculative` and its knobs, shared by `hf2q serve` and `hf2q generate`."""
    d = SpecConfig()
    parser.add_argument("--speculative", choices=METHODS, default=d.method,
                        help="draft tokens and verify them in one forward; the output is unchanged "
                             "(ngram: prompt lookup in the request's own history; mtp: the model's MTP head; "
                             "mtp+ngram: an n-gram match first, else MTP). Default: %(default)s")
    parser.add_argument("--num-speculative-tokens", dest="spec_tokens", type=int, choices=range(1, 4),
                        default=d.num_tokens, metavar="{1,2,3}",
                        help="drafts verified per step (k). Default: %(default)s")
    parser.add_argument("--spec-tokens", dest="spec_tokens", type=int, choices=range(1, 4),
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # the earlier name
    parser.add_argument("--spec-max-batch", type=int, default=d.max_batch,
                        help="no request drafts while this many or more requests decode together "
                             "(a large batch is compute-bound already). Default: %(default)s")
    parser.add_argument("--spec-cost-window", type=int, default=d.cost_window,
                        help="rounds per cost-control window: a proposer that saves no time in two windows in "
                             "a row is off for the rest of the request; 0 turns the control off. "
                             "Default: %(default)s")
    parser.add_argument("--spec-ngram-min", type=int, default=d.ngram_min, help="shortest history suffix matched (default: %(default)s)")
    parser.add_argument("--spec-ngram-max", type=int, default=d.ngram_max, help="longest history suffix tried first (default: %(default)s)")


def spec_config(args) -> SpecConfig:
    return SpecConfig(method=args.speculative, num_tokens=args.spec_tokens, ngram_min=args.spec_ngram_min,
                      ngram_max=args.spec_ngram_max, max_batch=args.spec_max_batch,
                      cost_window=args.spec_cost_window)


class Proposer(Protocol):
    """Drafts for one request. `history` is its prompt plus verified output: between two calls it only
    grows at the end (drafts are never part of it), so a proposer may index it incrementally."""

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that might follow `history` (possibly none)."""
        ...


class TokenView(Sequence[int]):
    """prompt + output of a request as one read-only sequence, without joining the two lists each step."""

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self.prompt)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.prompt[i] if i < n else self.output[i - n]
