"""The registry of retained prefixes: checkpoints of the hybrid cache that later prompts resume from.

A checkpoint is the K/V of a prefix (blocks shared by refcount) plus the DeltaNet state at exactly its last
token. That state is one running summary and cannot be cut back to an earlier token, so a checkpoint
serves only prompts that fully extend it (token-exact), and the scheduler takes checkpoints where later
prompts are likely to depart: at the latest-turn anchor, every `stride` prompt tokens, and at the end
of a finished request. The device data lives in `HybridCache` under each checkpoint's key; this module
is pure bookkeeping: lookup, a byte-budgeted LRU, and the counters for /metrics. With a `PrefixStore`,
new checkpoints are also written to disk, and a longer checkpoint found only on disk is loaded on its
first hit and kept in memory from then on.
"""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Optional

from hf2q.cache.block_manager import CacheFull
from hf2q.cache.hybrid import CacheSnapshot, HybridCache, LinearStates
from hf2q.cache.prefix_store import PrefixStore


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    evictions: int = 0
    # Re-render prefills (`Engine.prefill_in_background`): run to their checkpoint, the tokens they computed,
    # skipped (a checkpoint or a queued prefill already covered them), cancelled for a user request's room,
    # and absorbed (still queued when the next turn came: that turn computed the tokens itself).
    rerenders: int = 0
    rerender_tokens: int = 0
    rerender_skipped: int = 0
    rerender_cancelled: int = 0
    rerender_absorbed: int = 0


@dataclass
class Checkpoint:
    key: str
    tokens: tuple[int, ...]
    on_disk: bool = False  # found only in the store: `adopt` loads it


class PrefixCache:
    """Checkpoints of token prefixes, least recently used first, within `budget_bytes`.

    Evicting a checkpoint never disturbs a request that resumed from it: the request holds its own
    references to the shared blocks and its own copy of the state.
    """

    def __init__(self, cache: HybridCache, budget_bytes: int, disk: Optional[PrefixStore] = None):
        self.cache = cache
        self.budget_bytes = budget_bytes
        self.disk = disk
        self.stats = PrefixStats()
        self._entries: OrderedDict[tuple[int, ...], Checkpoint] = OrderedDict()  # by tokens, LRU first
        self._block_refs: Counter[int] = Counter()  # pool block -> how many checkpoints hold it
        self._keys = (f"p{i}" for i in itertools.count())
        self._block_bytes = cache.bytes_per_token * cache.block_size
        self._loaded: Optional[tuple[tuple[int, ...], CacheSnapshot]] = None  # read, but no room to restore yet

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held: distinct K/V blocks (shared ones once) plus one DeltaNet state per checkpoint."""
        return len(self._block_refs) * self._block_bytes + len(self._entries) * self.cache.fixed_bytes_per_slot

    def lookup(self, prompt: list[int]) -> Optional[Checkpoint]:
        """The longest checkpoint the prompt strictly extends (one token at least is left to compute)."""
        best: Optional[Checkpoint] = None
        for tokens, ckpt in self._entries.items():
            n = len(tokens)
            if n < len(prompt) and (best is None or n > len(best.tokens)) and tuple(prompt[:n]) == tokens:
                best = ckpt
        if self.disk is not None:
            tokens = self.disk.lookup(prompt, longer_than=len(best.tokens) if best else 0)
            if tokens is not None:
                return Checkpoint("", tokens, on_disk=True)
        return best

    def holds(self, tokens: list[int]) -> bool:
        """Whether a checkpoint of exactly these tokens is kept, in memory or on disk."""
        key = tuple(tokens)
        return key in self._entries or (self.disk is not None and self.disk.has(key))

    def adopt(self, ckpt: Checkpoint, slot: int) -> int:
        """Start `slot` from the checkpoint; returns the tokens it covers (0 when a file on disk turns out
        bad: a miss). CacheFull if no block is free."""
        if ckpt.on_disk:
            return self._load(ckpt, slot)
        n = self.cache.resume(ckpt.key, slot)
        self._entries.move_to_end(ckpt.tokens)
        return n

    def count(self, reused: int) -> None:
        """Count one admission: a hit that resumed `reused` tokens, or a miss (0)."""
        if reused:
            self.stats.hits += 1
            self.stats.tokens_reused += reused
        else:
            self.stats.misses += 1

    def store(self, slot: int, tokens: list[int], states: Optional[LinearStates] = None) -> None:
        """Retain the slot's committed state, which covers exactly `tokens` (with `states`: its first
        len(tokens) tokens, whose DeltaNet states those are); a no-op if already held or if no block is free
        for the partial last block (a checkpoint is an optimisation, never a failure)."""
        key_tokens = tuple(tokens)
        n = self.cache.seq_len(slot)
        if not key_tokens or (n != len(key_tokens) if states is None else n < len(key_tokens)):
            return
        if key_tokens in self._entries:
            self._entries.move_to_end(key_tokens)
            return
        key = next(self._keys)
        try:
            self.cache.retain(slot, key, len(key_tokens), states)
        except CacheFull:
            return
        self._entries[key_tokens] = Checkpoint(key, key_tokens)
        self._block_refs.update(self.cache.retained_blocks(key))
        if self.disk is not None:
            self.disk.save(self.cache, slot, key_tokens, states)
        while self._entries and self.nbytes > self.budget_bytes:
            self._evict_lru()

    def make_room(self, blocks: int, keep: Optional[Checkpoint] = None) -> bool:
        """Evict least recently used checkpoints until `blocks` pool blocks are free. Evicts nothing and
        returns False when even evicting all of them would not free enough (running requests hold them)."""
        pool = self.cache.blocks
        reclaimable = sum(1 for b, n in self._block_refs.items() if pool.ref_count(b) == n)
        if pool.num_free_blocks + reclaimable < blocks:
            return False
        for tokens in list(self._entries):
            if pool.num_free_blocks >= blocks:
                break
            if keep is None or tokens != keep.tokens:
                self._evict(tokens)
        return pool.num_free_blocks >= blocks

    def _load(self, ckpt: Checkpoint, slot: int) -> int:
        loaded = self._loaded
        snap = loaded[1] if loaded is not None and loaded[0] == ckpt.tokens else self.disk.load(ckpt.tokens)
        if snap is None:
            return 0
        self._loaded = (ckpt.tokens, snap)  # admission may retry after evicting for room: read the file once
        self.cache.restore(slot, snap)
        self._loaded = None
        self.store(slot, list(ckpt.tokens))  # later hits resume from memory
        return snap.num_tokens

    def clear(self) -> None:
        for tokens in list(self._entries):
            self._evict(tokens)

    def _evict_lru(self) -> None:
        self._evict(next(iter(self._entries)))

    def _evict(self, tokens: tuple[int, ...]) -> None:
        ckpt = self._entries.pop(tokens)
        self._block_refs.subtract(self.cache.retained_blocks(ckpt.key))
        self._block_refs += Counter()  # drop zero counts
        self.cache.drop(ckpt.key)
        self.stats.evictions += 1
