"""The DeltaNet states after the first tokens of a prefill chunk: a prefix-cache checkpoint inside the chunk.

The state is one running summary, so a checkpoint at token n needs the state there. Cutting the chunk at n
gives it, at the price of a step of its own (a chat turn's anchor sits a few tokens before the prompt's end,
so every turn would pay two steps before its first token). Instead the DeltaNet layers also run the delta
rule over the chunk's first tokens as one more sequence of the same kernel call and hand the state here; a
step replayed in a prefill graph walks the rows one by one and writes the state after the chosen one.
"""
from __future__ import annotations

import torch

from hf2q.cache.hybrid import HybridCache, LinearStates


class _LayerStates:
    """conv [n_lin, K-1, C] and recurrent [n_lin, h, dk, dv] in the cache's state layout and dtype, one layer's
    pair filled by each DeltaNet layer of a forward (`_filled`); `states` refuses them until every layer has."""

    kept_by = "the forward"

    def __init__(self, cache: HybridCache):
        conv, recurrent = cache.empty_linear_states(1)
        self.conv, self.recurrent = conv[:, 0], recurrent[:, 0]
        self._seen: set[int] = set()

    def _filled(self, j: int) -> None:
        self._seen.add(j)

    @property
    def states(self) -> LinearStates:
        if len(self._seen) != self.conv.shape[0]:
            raise RuntimeError(f"{self.kept_by} kept states of {len(self._seen)} of {self.conv.shape[0]} "
                               "DeltaNet layers")
        return self.conv, self.recurrent


class StateAt(_LayerStates):
    """The states after `offset` tokens of one sequence's chunk (what a chunk ending there leaves in the slot)."""

    def __init__(self, cache: HybridCache, offset: int):
        super().__init__(cache)
        self.lengths = (offset,)  # the chunk prefix the DeltaNet layers hand the state after

    def __call__(self, j: int, conv_inputs: torch.Tensor, recurrent: torch.Tensor) -> None:
        """DeltaNet layer j's states: conv_inputs [K-1 + offset, C] (the slot's previous raw inputs, then the
        chunk's first `offset`), recurrent [1, h, dk, dv] after them."""
        km1 = self.conv.shape[1]
        if km1:
            self.conv[j].copy_(conv_inputs[conv_inputs.shape[0] - km1:])
        self.recurrent[j].copy_(recurrent[0])
        self._filled(j)


class GraphStateAt(_LayerStates):
    """The same states from a prefill step replayed in a CUDA graph (hf2q.engine.prefill_graphs): static buffers
    every DeltaNet layer's step writes after one row of one sequence, named by `at` ([2] int on the device:
    sequence, row; -1 for none), which the graph reads at each replay, so one capture serves every step.
    `states` are views, valid until the graph's next replay (retaining them copies them)."""

    kept_by = "the graph"

    def __init__(self, cache: HybridCache, at: torch.Tensor):
        super().__init__(cache)
        self.at = at

    def layer(self, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(at, conv [K-1, C], recurrent [h, dk, dv]) of DeltaNet layer j, for its step to write
        (gdn_ops.gdn_verify_)."""
        self._filled(j)
        return self.at, self.conv[j], self.recurrent[j]
