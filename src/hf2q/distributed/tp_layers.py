"""What tensor parallelism adds to the single-device model: a sum after each block and a vocab-parallel head.

A rank's mixer or FFN, built by the ordinary model classes from the rank's local config and filled with its
slices of the weights, returns a partial sum of the block output (its heads' or FFN rows' share of the
row-parallel output projection). A forward hook on the block (`reduce_output`) sums the partials over the
group, so the model code needs no tensor-parallel twin. For MoE the hook sits on the whole FFN: the routed
experts and the shared expert are combined first, then reduced once. The LM head is a `VocabParallelHead`.

`group=None` means no communication: each rank returns its partial sums / logits slice, which lets
tests check the sharding in one process by summing the ranks' outputs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hf2q.layers.linear import Linear
from hf2q.models.qwen35 import head_logits


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of `x` over the ranks of `group` (in place); `x` itself when there is no group."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def all_gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dimension, in rank order."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class ReduceOutput:
    """Forward hook: the module's output (a rank's partial sum) summed over `group`."""

    def __init__(self, group):
        self.group = group

    def __call__(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return all_reduce(output, self.group)

    def __repr__(self) -> str:
        return f"ReduceOutput(group={self.group!r})"


def reduce_output(module: nn.Module, group) -> None:
    """Make `module` return the sum of its output over the ranks of `group`."""
    module.register_forward_hook(ReduceOutput(group))


class VocabParallelHead(nn.Module):
    """LM head of one rank: `shard` holds its rows of the vocabulary (padded to an equal count on every
    rank, the padding never read); logits are computed like the single-device head's, all-gathered and
    trimmed to the vocabulary. The model calls it in place of its own head (`Qwen35Model.compute_logits`)."""

    def __init__(self, shard: Linear, vocab_size: int, group):
        super().__init__()
        self.shard, self.vocab_size, self.group = shard, vocab_size, group

    @property
    def qtype(self) -> str | None:
        """The shard's quantized type: the final norm writes int8 rows for it as for a single-device head."""
        return self.shard.qtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = head_logits(hidden, self.shard)  # fp32 [T, padded vocab / world]
        if self.group is None:
            return local
        return all_gather_last(local, self.group)[..., : self.vocab_size]
