"""Paged K/V bookkeeping in plain Python: a free list, block refcounts and one block table per slot.

Device tensors live elsewhere (`hf2q.cache.hybrid`); this module only decides which block of the pool
holds which token. Full blocks may be shared between slots by refcount. K/V is append-only, so the only
block ever written is the one holding a slot's next position; whenever that block is shared, the manager
hands out a private copy target first (copy-on-write) and returns the (source, target) pairs to copy.
"""
from __future__ import annotations

from collections import deque


class CacheError(RuntimeError):
    """Base class of the cache's typed errors."""


class CacheFull(CacheError):
    """Not enough free K/V blocks for the request; nothing was changed."""


CopyPairs = list[tuple[int, int]]  # (source block, target block): copy source's contents into target


class BlockManager:
    """Free list, refcounts and per-slot block tables for a pool of `num_blocks` blocks of `block_size` tokens.

    A "slot" is any hashable holder of a table: the cache's slots, and its retained prefixes.
    Each slot also records `num_tokens(slot)`: the token count its table was last sized for. Positions
    below it may sit in shared blocks; the block that holds position `num_tokens(slot)` is made private
    before the slot grows, so writes never land in a shared block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 0 or block_size <= 0:
            raise ValueError(f"need num_blocks >= 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._tokens: dict[int, int] = {}

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use (0.0 for an empty pool)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    def block_table(self, slot: int) -> list[int]:
        return list(self._tables.get(slot, ()))

    def num_tokens(self, slot: int) -> int:
        return self._tokens.get(slot, 0)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self._free)

    def reclaimable(self, slot: int) -> int:
        """Blocks that `free(slot)` would return to the free list (those not shared with another slot)."""
        return sum(1 for b in self._tables.get(slot, ()) if self._refs[b] == 1)

    def blocks_needed(self, slot: int, new_len: int) -> int:
        """Free blocks `allocate_for(slot, new_len)` would take, copy-on-write target included."""
        cur = self.num_tokens(slot)
        if new_len <= cur:
            return 0
        return self.blocks_for(new_len) - len(self._tables.get(slot, ())) + int(self._needs_cow(slot))

    # ---- changes -------------------------------------------------------------------------------
    def allocate_for(self, slot: int, new_len: int) -> CopyPairs:
        """Grow `slot`'s table to hold `new_len` tokens; never shrinks. Returns the copy-on-write pairs.

        Raises CacheFull, changing nothing, when the free list is too short.
        """
        need = self.blocks_needed(slot, new_len)
        if need > len(self._free):
            raise CacheFull(f"slot {slot} needs {need} blocks for {new_len} tokens, {len(self._free)} free")
        if new_len <= self.num_tokens(slot):
            return []
        table = self._tables.setdefault(slot, [])
        pairs: CopyPairs = []
        if self._needs_cow(slot):
            i = self.num_tokens(slot) // self.block_size
            fresh = self._take()
            pairs.append((table[i], fresh))
            self._release(table[i])
            table[i] = fresh
        while len(table) < self.blocks_for(new_len):
            table.append(self._take())
        self._tokens[slot] = new_len
        return pairs

    def truncate(self, slot: int, new_len: int) -> None:
        """Keep `slot`'s first `new_len` tokens; blocks wholly past them go back to the pool."""
        if new_len < 0:
            raise ValueError(f"negative length {new_len}")
        if new_len >= self.num_tokens(slot):
            return
        table = self._tables[slot]
        keep = self.blocks_for(new_len)
        for b in table[keep:]:
            self._release(b)
        del table[keep:]
        self._tokens[slot] = new_len

    def free(self, slot: int) -> None:
        """Drop every block reference `slot` holds."""
        for b in self._tables.pop(slot, ()):
            self._release(b)
        self._tokens.pop(slot, None)

    def share(self, src: int, dst: int, num_tokens: int | None = None) -> CopyPairs:
        """Make `dst` hold `src`'s first `num_tokens` tokens (default: all of them).

        `dst`'s old blocks are dropped. Full blocks are shared by refcount; a partial last block gets a
        fresh target in `dst`, returned as a (src_block, dst_block) pair for the caller to copy.
        Raises CacheFull, changing nothing, when that fresh block cannot be had.
        """
        if src == dst:
            raise ValueError("share needs two different slots")
        n = self.num_tokens(src) if num_tokens is None else num_tokens
        if not 0 <= n <= self.num_tokens(src):
            raise ValueError(f"slot {src} holds {self.num_tokens(src)} tokens, cannot share {n}")
        full, partial = divmod(n, self.block_size)
        if partial and len(self._free) + self.reclaimable(dst) < 1:
            raise CacheFull(f"no free block for the partial block of slot {src}")
        self.free(dst)
        src_table = self._tables.get(src, [])
        table = src_table[:full]
        for b in table:
            self._refs[b] += 1
        pairs: CopyPairs = []
        if partial:
            fresh = self._take()
            pairs.append((src_table[full], fresh))
            table.append(fresh)
        self._tables[dst] = table
        self._tokens[dst] = n
        return pairs

    # ---- internals -----------------------------------------------------------------------------
    def _needs_cow(self, slot: int) -> bool:
        cur = self.num_tokens(slot)
        if cur % self.block_size == 0:
            return False
        return self._refs[self._tables[slot][cur // self.block_size]] > 1

    def _take(self) -> int:
        b = self._free.popleft()
        self._refs[b] = 1
        return b

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
