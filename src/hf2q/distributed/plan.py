"""Which heads and rows each tensor-parallel rank owns, and the per-rank `ModelConfig` that follows.

Pure bookkeeping (no process group): every rank computes the same plan from the model config, its
rank and the world size. Heads are split in whole units; when there are fewer K/V heads (or DeltaNet
key heads) than ranks, each is replicated over `world / n` ranks, as vLLM does for K/V.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hf2q.config import ModelConfig


class ShardingError(ValueError):
    """The model's head counts or widths cannot be split over this many ranks."""


def _split(n: int, world: int, rank: int, what: str, allow_replicas: bool = False) -> list[int]:
    """Contiguous units of `n` owned by `rank`; one replicated unit per rank when n < world divides it."""
    if n % world == 0:
        per = n // world
        return list(range(rank * per, (rank + 1) * per))
    if allow_replicas and world % n == 0:
        return [rank // (world // n)]
    rule = f"divisible by {world}" + (f" (or a divisor of {world})" if allow_replicas else "")
    raise ShardingError(f"tensor parallel size {world}: {what} is {n}, which must be {rule}")


@dataclass(frozen=True)
class RankPlan:
    """What rank `rank` of `world` holds. Head lists are global indices in this rank's local order."""

    rank: int
    world: int
    attn_heads: list[int]
    kv_heads: list[int]
    key_heads: list[int]  # DeltaNet key heads
    value_heads: list[int]  # DeltaNet value heads, tiled: local value head h uses local key head h % len(key_heads)
    local: ModelConfig  # this rank's config: local head counts and FFN widths, full vocabulary

    def ffn_rows(self, width: int, what: str = "FFN width") -> torch.Tensor:
        """This rank's rows of an FFN hidden dimension of `width` (column-parallel in, row-parallel out)."""
        return torch.tensor(_split(width, self.world, self.rank, what))

    def vocab_rows(self, vocab: int) -> tuple[int, int, int]:
        """(start, end, padded length) of this rank's vocabulary slice; the last may be short."""
        per = -(-vocab // self.world)
        start = min(self.rank * per, vocab)
        return start, min(start + per, vocab), per


def deltanet_heads(nk: int, nv: int, world: int, rank: int) -> tuple[list[int], list[int]]:
    """Key heads and (tiled) value heads of one rank.

    GGUF value head h reads key head h % nk, so key head k owns value heads k, k + nk, k + 2 nk, ...
    A rank keeps whole key heads with all (or, when key heads are replicated, an equal share of) their
    value heads, ordered so that local value head h again reads local key head h % local_nk.
    """
    if nv % nk:
        raise ShardingError(f"DeltaNet value heads {nv} are not a multiple of key heads {nk}")
    keys = _split(nk, world, rank, "DeltaNet key heads", allow_replicas=True)
    rep = nv // nk
    if nk % world == 0:
        groups = list(range(rep))
    else:  # key head replicated over `world // nk` ranks: each takes an equal share of its value heads
        share = world // nk
        if rep % share:
            raise ShardingError(f"tensor parallel size {world}: each of the {nk} DeltaNet key heads has {rep} "
                                f"value heads, which cannot be split over {share} ranks")
        part = rank % share
        groups = list(range(part * rep // share, (part + 1) * rep // share))
    return keys, [k + j * nk for j in groups for k in keys]


def plan_rank(cfg: ModelConfig, rank: int, world: int) -> RankPlan:
    """The plan of one rank; ShardingError (naming the count) when a head count does not split."""
    if world < 1 or not 0 <= rank < world:
        raise ShardingError(f"rank {rank} is outside a world of size {world}")
    heads = _split(cfg.num_heads, world, rank, "the number of attention heads")
    kv = _split(cfg.num_kv_heads, world, rank, "the number of K/V heads", allow_replicas=True)
    if heads and heads[0] * cfg.num_kv_heads // cfg.num_heads != kv[0]:
        raise ShardingError(f"tensor parallel size {world}: attention heads of rank {rank} span several K/V heads")
    keys, values = deltanet_heads(cfg.linear_num_k_heads, cfg.linear_num_v_heads, world, rank)
    local = dataclasses.replace(
        cfg, num_heads=len(heads), num_kv_heads=len(kv), linear_num_k_heads=len(keys),
        linear_num_v_heads=len(values),
        intermediate_size=_local_width(cfg.intermediate_size, world, "the dense FFN width"),
        moe_intermediate_size=_local_width(cfg.moe_intermediate_size, world, "the expert FFN width"),
        shared_expert_intermediate_size=_local_width(cfg.shared_expert_intermediate_size, world,
                                                     "the shared-expert FFN width"))
    return RankPlan(rank, world, heads, kv, keys, values, local)


def _local_width(width: int, world: int, what: str) -> int:
    if width % world:
        raise ShardingError(f"tensor parallel size {world}: {what} is {width}, which must be divisible by {world}")
    return width // world


def head_rows(heads: list[int], size: int, offset: int = 0) -> torch.Tensor:
    """Row indices of whole heads of `size` rows each, in the given order, shifted by `offset`."""
    return torch.cat([torch.arange(offset + h * size, offset + (h + 1) * size) for h in heads])
