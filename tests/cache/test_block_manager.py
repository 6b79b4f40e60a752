"""Pure-Python block bookkeeping: allocation, refcounts, sharing, truncation, exhaustion."""
from __future__ import annotations

import random

import pytest

from hf2q.cache.block_manager import BlockManager, CacheError, CacheFull


def state(bm: BlockManager, slots=range(4)):
    return ([bm.block_table(s) for s in slots], [bm.num_tokens(s) for s in slots], bm.num_free_blocks,
            [bm.ref_count(b) for b in range(bm.num_blocks)])


def check_invariants(bm: BlockManager, slots=range(4)):
    """Refcounts equal the number of table entries; free blocks are exactly those with refcount 0."""
    counts = [0] * bm.num_blocks
    for s in slots:
        table = bm.block_table(s)
        assert len(table) == bm.blocks_for(bm.num_tokens(s))
        assert len(set(table)) == len(table)
        for b in table:
            counts[b] += 1
    assert counts == [bm.ref_count(b) for b in range(bm.num_blocks)]
    assert bm.num_free_blocks == counts.count(0)
    assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks


def test_allocate_grows_and_never_shrinks():
    bm = BlockManager(10, 4)
    assert bm.allocate_for(0, 5) == []
    assert len(bm.block_table(0)) == 2 and bm.num_tokens(0) == 5
    first = bm.block_table(0)
    bm.allocate_for(0, 8)
    assert bm.block_table(0) == first  # 8 tokens still fit in 2 blocks
    bm.allocate_for(0, 9)
    assert bm.block_table(0)[:2] == first and len(bm.block_table(0)) == 3
    bm.allocate_for(0, 3)
    assert len(bm.block_table(0)) == 3 and bm.num_tokens(0) == 9
    assert bm.num_free_blocks == 7 and bm.usage == pytest.approx(0.3)
    check_invariants(bm)


def test_blocks_of_different_slots_are_disjoint():
    bm = BlockManager(12, 4)
    for s, n in enumerate([5, 9, 1, 12]):
        bm.allocate_for(s, n)
    tables = [set(bm.block_table(s)) for s in range(4)]
    assert sum(len(t) for t in tables) == len(set().union(*tables)) == 2 + 3 + 1 + 3
    check_invariants(bm)


def test_cache_full_changes_nothing_and_is_typed():
    bm = BlockManager(5, 4)
    bm.allocate_for(0, 10)  # 3 blocks
    bm.allocate_for(1, 4)  # 1 block
    before = state(bm)
    assert not bm.can_allocate(2) and bm.can_allocate(1)
    with pytest.raises(CacheFull):
        bm.allocate_for(1, 12)  # needs 2 more
    with pytest.raises(CacheError):
        bm.allocate_for(2, 9)
    assert state(bm) == before
    bm.allocate_for(1, 8)  # exactly the last block
    assert bm.num_free_blocks == 0
    check_invariants(bm)


def test_exhaustion_and_recovery():
    bm = BlockManager(8, 2)
    for s in range(4):
        bm.allocate_for(s, 4)
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    with pytest.raises(CacheFull):
        bm.allocate_for(0, 5)
    bm.free(2)
    assert bm.num_free_blocks == 2 and bm.block_table(2) == [] and bm.num_tokens(2) == 0
    bm.allocate_for(0, 8)
    assert len(bm.block_table(0)) == 4
    check_invariants(bm)
    for s in range(4):
        bm.free(s)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    check_invariants(bm)


def test_truncate_frees_tail_blocks_only():
    bm = BlockManager(10, 4)
    bm.allocate_for(0, 14)  # 4 blocks
    bm.allocate_for(1, 6)
    other = state(bm, [1])
    table = bm.block_table(0)
    bm.truncate(0, 5)
    assert bm.block_table(0) == table[:2] and bm.num_tokens(0) == 5
    assert all(bm.ref_count(b) == 0 for b in table[2:])
    bm.truncate(0, 8)  # no-op: truncation never grows
    assert bm.block_table(0) == table[:2] and bm.num_tokens(0) == 5
    bm.truncate(0, 0)
    assert bm.block_table(0) == []
    assert state(bm, [1])[:2] == other[:2]
    with pytest.raises(ValueError):
        bm.truncate(1, -1)
    check_invariants(bm)


def test_share_full_blocks_by_refcount_and_copies_partial():
    bm = BlockManager(10, 4)
    bm.allocate_for(0, 10)  # blocks a b c, c partial (2 tokens)
    a, b, c = bm.block_table(0)
    bm.allocate_for(1, 3)
    old_dst = bm.block_table(1)
    pairs = bm.share(0, 1)
    dst = bm.block_table(1)
    assert dst[:2] == [a, b] and dst[2] not in (a, b, c)
    assert pairs == [(c, dst[2])]
    assert bm.ref_count(a) == bm.ref_count(b) == 2 and bm.ref_count(c) == 1
    assert bm.ref_count(old_dst[0]) == 0  # dst's previous block went back
    assert bm.num_tokens(1) == 10 and bm.block_table(0) == [a, b, c]
    check_invariants(bm)
    # Freeing the source keeps the shared blocks alive for the destination.
    bm.free(0)
    assert bm.ref_count(a) == bm.ref_count(b) == 1 and bm.ref_count(c) == 0
    check_invariants(bm)


def test_share_at_block_boundary_copies_nothing():
    bm = BlockManager(6, 4)
    bm.allocate_for(0, 8)
    assert bm.share(0, 1) == []
    assert bm.block_table(1) == bm.block_table(0)
    assert bm.num_free_blocks == 4
    pairs = bm.share(0, 2, num_tokens=5)  # a shorter prefix
    assert bm.block_table(2)[0] == bm.block_table(0)[0] and len(pairs) == 1
    assert pairs[0][0] == bm.block_table(0)[1]
    with pytest.raises(ValueError):
        bm.share(0, 0)
    with pytest.raises(ValueError):
        bm.share(0, 3, num_tokens=9)
    check_invariants(bm)


def test_share_cache_full_changes_nothing():
    bm = BlockManager(3, 4)
    bm.allocate_for(0, 10)
    before = state(bm)
    with pytest.raises(CacheFull):
        bm.share(0, 1)
    assert state(bm) == before
    bm.truncate(0, 8)  # now the share needs no fresh block
    assert bm.share(0, 1) == []
    check_invariants(bm)


def test_growth_after_truncate_into_shared_block_copies_on_write():
    bm = BlockManager(8, 4)
    bm.allocate_for(0, 8)
    bm.share(0, 1)  # both full blocks shared
    a, b = bm.block_table(0)
    bm.truncate(0, 6)  # slot 0's next write lands in shared block b
    assert bm.blocks_needed(0, 7) == 1
    pairs = bm.allocate_for(0, 7)
    fresh = bm.block_table(0)[1]
    assert pairs == [(b, fresh)] and fresh != b
    assert bm.block_table(1) == [a, b] and bm.ref_count(b) == 1 and bm.ref_count(a) == 2
    assert bm.allocate_for(0, 8) == []  # now private: no more copies
    check_invariants(bm)


def test_copy_on_write_respects_cache_full():
    bm = BlockManager(2, 4)
    bm.allocate_for(0, 8)
    bm.share(0, 1)
    bm.truncate(0, 6)
    before = state(bm)
    with pytest.raises(CacheFull):
        bm.allocate_for(0, 7)
    assert state(bm) == before


def test_random_operations_keep_invariants():
    rng = random.Random(0)
    bm = BlockManager(24, 4)
    for _ in range(2000):
        s, n = rng.randrange(4), rng.randrange(0, 30)
        op = rng.choice(["alloc", "trunc", "free", "share"])
        before = state(bm)
        try:
            if op == "alloc":
                bm.allocate_for(s, n)
            elif op == "trunc":
                bm.truncate(s, n)
            elif op == "free":
                bm.free(s)
            else:
                d = rng.randrange(4)
                if d != s:
                    bm.share(s, d)
        except CacheFull:
            assert state(bm) == before
        check_invariants(bm)


def test_random_operations_never_write_into_shared_blocks():
    """Simulate a pool: each slot writes its own tokens after growing; every slot must read back its own."""
    rng = random.Random(1)
    bm = BlockManager(20, 4)
    pool = [[None] * 4 for _ in range(20)]
    logical: dict[int, list] = {s: [] for s in range(4)}

    def read(s):
        t = bm.block_table(s)
        return [pool[t[p // 4]][p % 4] for p in range(bm.num_tokens(s))]

    for step in range(3000):
        s, n = rng.randrange(4), rng.randrange(0, 24)
        op = rng.choice(["grow", "grow", "trunc", "free", "share"])
        try:
            if op == "grow" and n > bm.num_tokens(s):
                cur = bm.num_tokens(s)
                for src, dst in bm.allocate_for(s, n):
                    pool[dst] = list(pool[src])
                t = bm.block_table(s)
                for p in range(cur, n):
                    pool[t[p // 4]][p % 4] = (s, step, p)
                logical[s] = logical[s][:cur] + [(s, step, p) for p in range(cur, n)]
            elif op == "trunc":
                bm.truncate(s, n)
                logical[s] = logical[s][:n]
            elif op == "free":
                bm.free(s)
                logical[s] = []
            elif op == "share":
                d = rng.randrange(4)
                if d != s:
                    for src, dst in bm.share(s, d):
                        pool[dst] = list(pool[src])
                    logical[d] = list(logical[s])
        except CacheFull:
            pass
        for slot in range(4):
            assert read(slot) == logical[slot]
