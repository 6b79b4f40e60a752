"""What a draft proposer is, and the speculation settings.

A proposer guesses the next few tokens of one request from what it has seen; the engine then checks
every guess against the target model in one forward, so a bad guess costs time, never correctness.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

METHODS = ("off", "ngram", "mtp", "mtp+ngram")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "off"  # one of METHODS
    num_tokens: int = 3  # drafts verified per step (k); the verify forward is k + 1 positions
    ngram_min: int = 6  # shortest suffix of the history the n-gram proposer matches
    ngram_max: int = 12  # longest suffix tried first

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r} (choose from {', '.join(METHODS)})")
        if self.num_tokens < 1:
            raise ValueError(f"spec tokens must be at least 1, got {self.num_tokens}")
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
    parser.add_argument("--spec-tokens", type=int, default=d.num_tokens, help="drafts per step (k) (default: %(default)s)")
    parser.add_argument("--spec-ngram-min", type=int, default=d.ngram_min, help="shortest history suffix matched (default: %(default)s)")
    parser.add_argument("--spec-ngram-max", type=int, default=d.ngram_max, help="longest history suffix tried first (default: %(default)s)")


def spec_config(args) -> SpecConfig:
    return SpecConfig(method=args.speculative, num_tokens=args.spec_tokens, ngram_min=args.spec_ngram_min,
                      ngram_max=args.spec_ngram_max)


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
