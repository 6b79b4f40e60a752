"""The DeltaNet states after the first tokens of a prefill chunk: a prefix-cache checkpoint inside the chunk.

The state is one running summary, so a checkpoint at token n needs the state there. Cutting the chunk at n
gives it, at the price of a step of its own (a chat turn's anchor sits a few tokens before the prompt's end,
so every turn would pay two steps before its first token). Instead the DeltaNet layers also run the delta
rule over the chunk's first tokens as one more sequence of the same kernel call and hand the state here.
"""
from __future__ import annotations

import torch

from hf2q.cache.hybrid import HybridCache, LinearStates


class StateAt:
    """conv [n_lin, K-1, C] and recurrent [n_lin, h, dk, dv] after `offset` tokens of one sequence's chunk, in
    the cache's state layout and dtype (what a chunk ending there leaves in the slot)."""

    def __init__(self, cache: HybridCache, offset: int):
        self.lengths = (offset,)  # the chunk prefix the DeltaNet layers hand the state after
        conv, recurrent = cache.empty_linear_states(1)
        self.conv, self.recurrent = conv[:, 0], recurrent[:, 0]
        self._seen: set[int] = set()

    def __call__(self, j: int, conv_inputs: torch.Tensor, recurrent: torch.Tensor) -> None:
        """DeltaNet layer j's states: conv_inputs [K-1 + offset, C] (the slot's previous raw inputs, then the
        chunk's first `offset`), recurrent [1, h, dk, dv] after them."""
        km1 = self.conv.shape[1]
        if km1:
            self.conv[j].copy_(conv_inputs[conv_inputs.shape[0] - km1:])
        self.recurrent[j].copy_(recurrent[0])
        self._seen.add(j)

    @property
    def states(self) -> LinearStates:
        if len(self._seen) != self.conv.shape[0]:
            raise RuntimeError(f"the forward kept states of {len(self._seen)} of {self.conv.shape[0]} "
                               "DeltaNet layers")
        return self.conv, self.recurrent
