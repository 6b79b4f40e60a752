"""Tensor-parallel versions of the decoder blocks: the same math on a rank's heads, then one collective.

Each class subclasses the single-device layer and reuses its forward: a rank's mixer or FFN computes a
partial sum of the block output (its heads' share of the row-parallel output projection), and one
all-reduce per block restores the full output. The LM head is vocab-parallel and all-gathers logits.

`group=None` means no communication: each rank returns its partial sums / logits slice, which lets
tests check the sharding in one process by summing the ranks' outputs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf2q.config import ModelConfig
from hf2q.forward import ForwardBatch
from hf2q.layers.attention import GatedAttention
from hf2q.layers.gdn import GatedDeltaNet
from hf2q.layers.linear import Linear
from hf2q.layers.rotary import RotaryEmbedding
from hf2q.models.qwen35 import DecoderLayer, Qwen35Model


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


class TPGatedAttention(GatedAttention):
    """Column-parallel q(+gate)/k/v by head, row-parallel o; K/V pool holds this rank's K/V heads only."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, group):
        super().__init__(cfg, layer_id, rotary)
        self.group = group

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x, batch, cos, sin), self.group)


class TPGatedDeltaNet(GatedDeltaNet):
    """Column-parallel qkv/z/alpha/beta and conv by key-head group, row-parallel out.

    The recurrent state of a value head depends only on its own head's inputs, so each rank's state
    (the cache built from its local config) is complete for its heads and never communicated.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, group):
        super().__init__(cfg, layer_id)
        self.group = group

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return all_reduce(super().forward(x, batch), self.group)


class TPDecoderLayer(DecoderLayer):
    """A decoder layer whose FFN (dense or MoE) is all-reduced once at its output.

    The reduce sits here rather than in the FFN module because sharding builds the plain `MLP` / `MoE`
    for a rank's slice of the FFN.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, group):
        super().__init__(cfg, layer_id, rotary)
        self.group = group

    def _ffn(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return all_reduce(super()._ffn(h, batch), self.group)


class TPQwen35Model(Qwen35Model):
    """The decoder with a vocab-parallel LM head: each rank scores its vocabulary slice, then all-gather.

    `lm_shard` holds this rank's rows (padded to an equal length on every rank); with tied embeddings
    it is a view of the replicated embedding whenever no padding is needed.
    """

    def __init__(self, cfg: ModelConfig, tie_embeddings: bool, shard_rows: int, group):
        super().__init__(cfg, tie_embeddings)
        self.lm_head = None
        self.lm_shard = Linear(cfg.hidden_size, shard_rows)
        self.group = group

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.lm_shard.weight).float()  # [T, vocab / world]
        if self.group is None:
            return local
        return all_gather_last(local, self.group)[..., : self.config.vocab_size]
