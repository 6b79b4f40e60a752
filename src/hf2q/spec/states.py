"""The DeltaNet state after each position of a verify chunk, kept from the verify forward itself.

The conv and recurrent states cannot be rewound, so a partial accept needs the state as it was right
after the last accepted token. The DeltaNet layers hand each verifying sequence's per-position states
to its `PositionStates` during the verify forward; settling then copies the row of the last accepted
position into the slot, and no token is fed twice.
"""
from __future__ import annotations

import torch

from hf2q.cache.hybrid import HybridCache


class PositionStates:
    """conv [n_lin, n, K-1, C] and recurrent [n_lin, n, h, dk, dv]: row t is the state after chunk position t,
    in the cache's state layout and dtype (what a plain decode step leaves in the slot)."""

    def __init__(self, cache: HybridCache, n: int):
        self.conv, self.recurrent = cache.empty_linear_states(n)
        self.lengths = tuple(range(1, n + 1))  # the chunk prefixes the DeltaNet layers hand states after
        self._seen: set[int] = set()

    def __call__(self, j: int, conv_inputs: torch.Tensor, recurrent: torch.Tensor) -> None:
        """DeltaNet layer j's states of this chunk: conv_inputs [K-1 + n, C] (previous raw inputs, then the
        chunk's), recurrent [n, h, dk, dv] (after each position)."""
        km1 = self.conv.shape[2]
        windows = conv_inputs.unfold(0, km1, 1)[1:] if km1 else conv_inputs.new_empty(self.conv.shape[1:])
        self.conv[j].copy_(windows.transpose(1, 2) if km1 else windows)
        self.recurrent[j].copy_(recurrent)
        self._seen.add(j)

    def at(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent) of every DeltaNet layer after chunk position t."""
        if len(self._seen) != self.conv.shape[0]:
            raise RuntimeError(f"the verify forward kept states of {len(self._seen)} of {self.conv.shape[0]} "
                               "DeltaNet layers")
        return self.conv[:, t], self.recurrent[:, t]
