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


POSITIONS = 4  # rows whose logits a graph-replayed verify gives: the last decided token's and up to 3 drafts
PREFIXES = POSITIONS - 1  # states a settle may need: after one of the rows before the last (not after the last)


class KeptPositions:
    """The per-position DeltaNet states of a verify step replayed in a CUDA graph (hf2q.engine.prefill_graphs),
    in static buffers its DeltaNet layers write: a layout a captured graph can hold, whatever the step's rows.

    A settle needs the state after a row of a sequence's chunk other than its last (all accepted: the slot has
    it already). The verify step's DeltaNet kernel (hf2q.kernels.gdn.verify_triton) walks each of the graph's
    `max_seqs` sequences' rows on its slot in place and writes the states after each row t < min(L - 1,
    PREFIXES) (L: its rows) to row PREFIXES * i + t of these buffers; the rest of a row is left as it was.
    """

    def __init__(self, cache: HybridCache, max_seqs: int):
        self.max_seqs = max_seqs
        self.conv, self.recurrent = cache.empty_linear_states(PREFIXES * max_seqs)
        self._seen: set[int] = set()

    def layer(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DeltaNet layer j's buffers (conv [PREFIXES * max_seqs, K-1, C], recurrent [PREFIXES * max_seqs, h,
        dk, dv]), for its verify step to write."""
        self._seen.add(j)
        return self.conv[j], self.recurrent[j]

    def of(self, i: int) -> "KeptRow":
        return KeptRow(self, i)


class KeptRow:
    """Sequence i's states in a `KeptPositions` (what `Verify.states` reads), valid until the graph's next replay."""

    def __init__(self, kept: KeptPositions, i: int):
        self.kept, self.i = kept, i

    def at(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self.kept
        if len(kept._seen) != kept.conv.shape[0]:
            raise RuntimeError(f"the verify graph kept states of {len(kept._seen)} of {kept.conv.shape[0]} "
                               "DeltaNet layers")
        if not 0 <= t < PREFIXES:
            raise IndexError(f"no state kept after row {t} of a verify chunk")
        return kept.conv[:, PREFIXES * self.i + t], kept.recurrent[:, PREFIXES * self.i + t]
