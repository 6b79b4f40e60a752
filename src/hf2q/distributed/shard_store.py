"""Prefix checkpoints on disk under tensor parallelism: each rank writes and reads its own shard.

Rank r of N keeps its shard of every checkpoint in `DIR/tp{N}/rank{r}/`, a `PrefixStore` of its own whose
fingerprint names N and r (so a shard of another split is never read) and whose budget is the N-th part of the
disk budget. The ranks share the host's filesystem, and the files of one checkpoint have the same name in
every rank's directory.

Rank 0 decides, the other ranks follow, and they never diverge:
- Writes: when rank 0 queues a checkpoint it logs `save` with its cache operations; each rank replays it in
  order, so it snapshots the same slot at the same point and queues its own background write. A rank whose
  write is dropped or fails leaves that checkpoint incomplete: reading it later is a miss.
- Reads: a hit on disk is taken only when every rank's shard loads and verifies. Rank 0 reads its own, then
  asks the others (`LoadQuery`), which read theirs into memory and answer; any failure is a miss for all
  ranks and one log line on rank 0. The `restore` then logged uses the shard each rank holds in memory, so a
  file that vanishes after the answer changes nothing; a `restore` of a shard a rank does not hold (which
  would mean the ranks diverged) stops that rank with an error rather than letting it compute from another state.
- Eviction: rank 0's least recently used checkpoint leaves every rank's directory. Each other rank also holds
  its own directory to its budget, which bounds shards whose rank-0 file was never written or is gone.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from hf2q.cache.hybrid import CacheSnapshot, HybridCache, LinearStates
from hf2q.cache.prefix_store import PrefixStore, file_name, model_fingerprint
from hf2q.config import CacheConfig

log = logging.getLogger(__name__)


def rank_dir(directory: str | os.PathLike, rank: int, world: int) -> Path:
    return Path(directory) / f"tp{world}" / f"rank{rank}"


def rank_store(model, cc: CacheConfig, rank: int, world: int) -> PrefixStore:
    """A rank's own store of its shards (rank 0 uses `ShardedStore`, which also speaks for the others)."""
    return PrefixStore(rank_dir(cc.prefix_cache_dir, rank, world), cc.prefix_cache_disk_bytes // world,
                       model_fingerprint(model, cc, rank, world))


@dataclass(frozen=True)
class LoadQuery:
    """Rank 0 to the other ranks, between steps: load your shard of this checkpoint and say whether it verifies."""

    tokens: tuple[int, ...]


def _gather_reasons(why: Optional[str], group) -> list[Optional[str]]:
    """Every rank's reason for failing to load its shard (None: loaded), in rank order."""
    reasons: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, why, group=group)
    return reasons


class ShardedStore(PrefixStore):
    """Rank 0's store: its own shards, plus the logged writes, the load queries and the evictions that keep the
    other ranks' shards in step (see the module docstring)."""

    def __init__(self, model, cc: CacheConfig, group, world: int):
        super().__init__(rank_dir(cc.prefix_cache_dir, 0, world), cc.prefix_cache_disk_bytes // world,
                         model_fingerprint(model, cc, 0, world))
        self.group = group
        self.peers = [rank_dir(cc.prefix_cache_dir, r, world) for r in range(1, world)]

    def save(self, cache: HybridCache, slot: int, tokens: tuple[int, ...], states: Optional[LinearStates] = None
             ) -> bool:
        queued = super().save(cache, slot, tokens, states)
        if queued:
            cache.record("save", slot, tokens)  # a RecordingCache: the other ranks write their shards too
        return queued

    def read(self, tokens: tuple[int, ...]) -> CacheSnapshot:
        snap = super().read(tokens)  # rank 0's own shard failing is a miss the others never hear of
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list([LoadQuery(tokens)], src=src, group=self.group)
        for rank, why in enumerate(_gather_reasons(None, self.group)):
            if why is not None:
                self.forget(tokens)
                raise ValueError(f"rank {rank}'s shard {why}")
        return snap

    def _remove(self, path: Path) -> None:
        super()._remove(path)
        for peer in self.peers:
            (peer / path.name).unlink(missing_ok=True)


class ShardFiles:
    """The disk side of a rank other than 0: its store, and the shard it loaded for rank 0's next `restore`."""

    def __init__(self, store: Optional[PrefixStore], group):
        self.store = store
        self.group = group
        self.pending: Optional[CacheSnapshot] = None

    def answer(self, query: LoadQuery) -> None:
        """Load this rank's shard and tell every rank whether it verifies. The shard is kept only when every rank's
        did, as rank 0 then keeps its own; otherwise the one kept before stays (rank 0 keeps its earlier one too)."""
        snap, why = None, None
        try:
            if self.store is None:
                raise LookupError
            snap = self.store.read(query.tokens)
        except LookupError:
            why = f"{file_name(query.tokens)} is not on disk"
        except ValueError as err:
            why = str(err)
        if not any(_gather_reasons(why, self.group)):
            self.pending = snap

    def save(self, cache: HybridCache, slot: int, tokens: tuple[int, ...]) -> None:
        if self.store is not None:
            self.store.save(cache, slot, tokens)

    def restore(self, cache: HybridCache, slot: int, num_tokens: int) -> None:
        snap, self.pending = self.pending, None
        if snap is None or snap.num_tokens != num_tokens:
            raise RuntimeError(f"cache replay diverged: rank 0 restored a checkpoint of {num_tokens} tokens "
                               f"this rank has not loaded")
        cache.restore(slot, snap)

    def flush(self) -> None:
        if self.store is not None:
            self.store.flush()
