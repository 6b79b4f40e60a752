"""Hybrid cache: pool shapes and bytes, slot lifecycle, snapshots, forks, isolation, typed errors."""
from __future__ import annotations


import pytest
import torch

from hf2q.cache.hybrid import (CacheError, CacheFull, CacheSnapshot, HybridCache, NoFreeSlot, SlotError,
                               kv_bytes_per_token, state_bytes_per_slot)
from hf2q.config import CacheConfig, ModelConfig

# The tiny Qwen3.5 shape of the test checkpoints, with 8 layers: full attention at 3 and 7, plus one MTP layer.
SMALL = ModelConfig(
    arch="qwen35", hidden_size=32, num_layers=8, num_mtp_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
    rms_norm_eps=1e-6, context_length=256, rope_theta=1e7, rotary_dim=4, rope_sections=(1, 1, 0, 0),
    full_attention_interval=4, linear_num_k_heads=2, linear_num_v_heads=4, linear_k_head_dim=4,
    linear_v_head_dim=6, conv_kernel=4, vocab_size=100, intermediate_size=64,
)


@pytest.fixture(scope="module")
def tiny_dense_config(gguf_dense_f32) -> ModelConfig:
    """The tiny dense fixture's config, read from its GGUF."""
    from hf2q.checkpoint.gguf_file import GGUFFile

    return ModelConfig.from_gguf_metadata(GGUFFile(gguf_dense_f32).metadata)


def make(num_slots=4, num_blocks=40, block_size=4, device="cpu", **kw) -> HybridCache:
    cc = CacheConfig(num_slots=num_slots, num_blocks=num_blocks, block_size=block_size, **kw)
    return HybridCache(SMALL, cc, device=device)


def write(cache: HybridCache, slot: int, new_len: int, seed: int) -> None:
    """What a forward does: reserve, write K/V of the new positions and new state, commit."""
    g = torch.Generator().manual_seed(seed)
    start = cache.seq_len(slot)
    cache.reserve(slot, new_len)
    idx = cache.token_indices(slot, start, new_len)
    for pools in (cache.kv.k_layers, cache.kv.v_layers):
        for pool in pools:
            flat = pool.view(-1, SMALL.num_kv_heads, SMALL.head_dim)
            flat.index_copy_(0, idx, torch.randn(len(idx), *flat.shape[1:], generator=g).to(flat))
    for states in (cache.conv_state, cache.recurrent_state):
        for st in states:
            st[slot].copy_(torch.randn(st[slot].shape, generator=g).to(st))
    cache.commit(slot, new_len)


def view(cache: HybridCache, slot: int):
    """Everything a slot holds, read through the public contract (K/V of [0, len) and state)."""
    n = cache.seq_len(slot)
    idx = cache.token_indices(slot, 0, n)
    kv = [p.view(-1, SMALL.num_kv_heads, SMALL.head_dim)[idx].clone() for p in cache.kv.k_layers + cache.kv.v_layers]
    st = [s[slot].clone() for s in cache.conv_state + cache.recurrent_state]
    return n, kv, st


def same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1] + a[2], b[1] + b[2]))


def filled(lens=(5, 9, 0, 12)) -> HybridCache:
    cache = make()
    for s, n in enumerate(lens):
        assert cache.acquire() == s
        if n:
            write(cache, s, n, seed=100 + s)
    return cache


# ---- shapes and bytes ------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_pool_shapes_and_bytes_match_independent_formula(kv_dtype, tiny_dense_config):
    mc = tiny_dense_config
    cc = CacheConfig(num_slots=3, num_blocks=7, block_size=16, kv_dtype=kv_dtype)
    cache = HybridCache(mc, cc)
    full = [i for i in range(mc.num_layers) if (i + 1) % mc.full_attention_interval == 0]
    linear = [i for i in range(mc.num_layers) if i not in full]
    n_kv_layers = len(full) + mc.num_mtp_layers
    assert len(cache.kv.k_layers) == len(cache.kv.v_layers) == n_kv_layers
    assert len(cache.conv_state) == len(cache.recurrent_state) == len(linear)
    for p in cache.kv.k_layers + cache.kv.v_layers:
        assert p.shape == (7, 16, mc.num_kv_heads, mc.head_dim) and p.dtype == getattr(torch, kv_dtype)
    channels = mc.linear_num_k_heads * mc.linear_k_head_dim * 2 + mc.linear_num_v_heads * mc.linear_v_head_dim
    for c, r in zip(cache.conv_state, cache.recurrent_state):
        assert c.shape == (3, mc.conv_kernel - 1, channels) and c.dtype == torch.float32
        assert r.shape == (3, mc.linear_num_v_heads, mc.linear_k_head_dim, mc.linear_v_head_dim)
    kv_item = 4 if kv_dtype == "float32" else 2
    assert cache.bytes_per_token == n_kv_layers * 2 * mc.num_kv_heads * mc.head_dim * kv_item
    fixed = len(linear) * ((mc.conv_kernel - 1) * channels
                           + mc.linear_num_v_heads * mc.linear_k_head_dim * mc.linear_v_head_dim) * 4
    assert cache.fixed_bytes_per_slot == fixed
    held = sum(t.numel() * t.element_size() for t in cache.kv.k_layers + cache.kv.v_layers + cache.conv_state
               + cache.recurrent_state)
    assert cache.total_bytes == held == cache.bytes_per_token * 7 * 16 + fixed * 3


def test_ck_dense_numbers(tiny_dense_config):
    mc = tiny_dense_config  # 4 layers: full attention at 3, one MTP layer; 3 DeltaNet layers
    assert kv_bytes_per_token(mc, "float32") == 2 * 2 * 2 * 64 * 4
    assert state_bytes_per_slot(mc, "float32") == 3 * (3 * 256 + 4 * 32 * 32) * 4


def test_layer_routing():
    cache = make()
    assert [cache.kv_index(i) for i in (3, 7, 8)] == [0, 1, 2]  # 8 = num_layers + MTP layer 0
    assert [cache.linear_index(i) for i in (0, 1, 2, 4, 5, 6)] == list(range(6))
    for bad in (0, 9, -1):
        with pytest.raises(ValueError):
            cache.kv_index(bad)
    for bad in (3, 7, 8):
        with pytest.raises(ValueError):
            cache.linear_index(bad)


def test_plan_fits_budget():
    per_block = kv_bytes_per_token(SMALL, "float32") * 4
    fixed = state_bytes_per_slot(SMALL, "float32")
    cc = HybridCache.plan(SMALL, budget_bytes=fixed * 2 + per_block * 10 + per_block // 2, max_slots=2, block_size=4)
    assert (cc.num_slots, cc.num_blocks, cc.block_size) == (2, 10, 4)
    assert HybridCache(SMALL, cc).total_bytes <= fixed * 2 + per_block * 10 + per_block // 2
    capped = HybridCache.plan(SMALL, budget_bytes=10**12, max_slots=2, block_size=4)
    assert capped.num_blocks == 2 * SMALL.context_length // 4
    half = HybridCache.plan(SMALL, budget_bytes=fixed + per_block * 3 // 2, max_slots=1, block_size=4,
                            kv_dtype="bfloat16")
    assert half.num_blocks == 3 and half.kv_dtype == "bfloat16"
    with pytest.raises(CacheFull):
        HybridCache.plan(SMALL, budget_bytes=fixed * 2, max_slots=2, block_size=4)


# ---- slots and lengths -----------------------------------------------------------------------------
def test_acquire_release_and_typed_errors():
    cache = make(num_slots=2)
    assert cache.acquire() == 0 and cache.acquire() == 1
    with pytest.raises(NoFreeSlot):
        cache.acquire()
    cache.release(0)
    assert cache.usage().slots_used == 1
    for bad in (0, 2, -1):
        with pytest.raises(SlotError):
            cache.seq_len(bad)
        with pytest.raises(CacheError):
            cache.reserve(bad, 3)
    with pytest.raises(SlotError):
        cache.fork(1, 1)
    assert cache.acquire() == 0


def test_new_slot_starts_empty_and_zero_after_release():
    cache = filled()
    cache.release(1)
    assert cache.usage().kv_blocks_used == (2 + 0 + 3)  # 5 and 12 tokens in blocks of 4
    assert cache.acquire() == 1
    assert cache.seq_len(1) == 0 and cache.block_table(1) == []
    assert all(not s[1].any() for s in cache.conv_state + cache.recurrent_state)


def test_reserve_commit_truncate():
    cache = make(num_blocks=4)
    s = cache.acquire()
    write(cache, s, 6, seed=1)
    assert cache.seq_len(s) == 6 and len(cache.block_table(s)) == 2
    before = view(cache, s)
    with pytest.raises(CacheFull):
        cache.reserve(s, 17)
    assert same(view(cache, s), before) and cache.usage().kv_blocks_used == 2
    with pytest.raises(ValueError):
        cache.commit(s, 9)  # not reserved
    with pytest.raises(ValueError):
        cache.token_indices(s, 0, 9)
    cache.reserve(s, 10)
    with pytest.raises(ValueError):
        cache.commit(s, 5)  # commit never lowers the length
    cache.commit(s, 10)
    cache.truncate(s, 3)
    assert cache.seq_len(s) == 3 and len(cache.block_table(s)) == 1
    n, kv, _ = view(cache, s)
    assert all(torch.equal(a, b[:3]) for a, b in zip(kv, before[1]))
    with pytest.raises(ValueError):
        cache.truncate(s, 4)


def test_token_indices_address_the_slot_blocks():
    cache = filled()
    table = cache.block_table(3)
    idx = cache.token_indices(3, 2, 12).tolist()
    assert idx == [table[p // 4] * 4 + p % 4 for p in range(2, 12)]
    assert cache.token_indices(3, 5, 5).numel() == 0


# ---- snapshot, restore, fork -----------------------------------------------------------------------
def test_snapshot_restore_round_trip():
    cache = filled()
    before = view(cache, 1)
    snap = cache.snapshot(1)
    assert isinstance(snap, CacheSnapshot) and snap.num_tokens == 9
    assert snap.nbytes == 9 * cache.bytes_per_token + cache.fixed_bytes_per_slot
    write(cache, 1, 15, seed=7)  # later writes never reach the snapshot
    cache.reset(1)
    assert cache.seq_len(1) == 0
    cache.restore(1, snap)
    assert same(view(cache, 1), before)
    cache.restore(2, snap.to("cpu"))  # into another slot, with other blocks
    assert same(view(cache, 2), before)
    assert set(cache.block_table(2)).isdisjoint(cache.block_table(1))


def test_restore_cache_full_changes_nothing():
    cache = make(num_blocks=5)
    a, b = cache.acquire(), cache.acquire()
    write(cache, a, 12, seed=1)  # 3 blocks
    write(cache, b, 4, seed=2)  # 1 block
    snap = cache.snapshot(a)
    before = view(cache, b), view(cache, a)
    with pytest.raises(CacheFull):
        cache.restore(b, snap)  # needs 3, has 1 free + 1 own
    assert same(view(cache, b), before[0]) and same(view(cache, a), before[1])
    write(cache, b, 8, seed=3)
    cache.truncate(a, 8)
    cache.restore(b, snap)  # b's own 2 blocks + 2 free are enough
    assert same(view(cache, b), before[1])


def test_restore_rejects_foreign_snapshot():
    cache = filled()
    snap = cache.snapshot(0)
    bad = CacheSnapshot(snap.num_tokens, snap.k[:, :, :1], snap.v[:, :, :1], snap.conv, snap.recurrent)
    with pytest.raises(ValueError):
        cache.restore(0, bad)


@pytest.mark.parametrize("src_len", [0, 8, 9])  # empty, block boundary, partial last block
def test_fork_is_independent_both_ways(src_len):
    cache = make()
    src, dst, other = cache.acquire(), cache.acquire(), cache.acquire()
    write(cache, other, 5, seed=3)
    if src_len:
        write(cache, src, src_len, seed=1)
    write(cache, dst, 3, seed=2)  # dst's old contents are replaced
    src_view, other_view = view(cache, src), view(cache, other)
    cache.fork(src, dst)
    assert same(view(cache, dst), src_view)
    write(cache, dst, src_len + 6, seed=4)
    assert same(view(cache, src), src_view)
    dst_view = view(cache, dst)
    write(cache, src, src_len + 7, seed=5)
    assert same(view(cache, dst), dst_view)
    # Going back into a shared block and writing there must copy it first.
    cache.truncate(src, max(src_len - 3, 0))
    write(cache, src, src_len + 2, seed=6)
    assert same(view(cache, dst), dst_view) and same(view(cache, other), other_view)


def test_rewind_drops_kv_but_keeps_the_reserved_room():
    cache = make(num_blocks=6)
    s = cache.acquire()
    cache.reserve(s, 16)  # what admission reserves: the request's whole length
    write(cache, s, 11, seed=1)
    before = view(cache, s)
    cache.rewind(s, 6)
    assert cache.seq_len(s) == 6 and len(cache.block_table(s)) == 4  # nothing handed back
    assert cache.usage().kv_blocks_used == 4 and not cache.can_reserve(cache.acquire(), 12)
    assert all(torch.equal(a, b[:6]) for a, b in zip(view(cache, s)[1], before[1]))
    cache.commit(s, 16)  # the room past the rewind is still the slot's


def test_rewind_into_a_shared_block_copies_it():
    cache = filled()
    cache.fork(3, 2)  # slot 2 shares slot 3's three full blocks
    cache.rewind(2, 6)  # now ends inside the second block, which the next write would change
    assert cache.block_table(2)[0] == cache.block_table(3)[0]
    assert cache.block_table(2)[1] != cache.block_table(3)[1]
    n, kv, _ = view(cache, 2)
    assert n == 6 and all(torch.equal(a, b[:6]) for a, b in zip(kv, view(cache, 3)[1]))


def test_fork_shares_full_blocks():
    cache = filled()
    cache.fork(3, 2)  # 12 tokens = 3 full blocks
    assert cache.block_table(2) == cache.block_table(3)
    used = cache.usage().kv_blocks_used
    cache.fork(1, 2)  # 9 tokens: 2 shared, 1 copied; dst's shared references are dropped
    assert cache.block_table(2)[:2] == cache.block_table(1)[:2]
    assert cache.block_table(2)[2] != cache.block_table(1)[2]
    assert cache.usage().kv_blocks_used == used + 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_snapshot_fork_on_cuda():
    cache = make(device="cuda", kv_dtype="bfloat16")
    a, b, c = cache.acquire(), cache.acquire(), cache.acquire()
    write(cache, a, 9, seed=1)
    write(cache, c, 5, seed=2)
    kept = view(cache, c)
    snap = cache.snapshot(a)
    assert snap.k.device.type == "cuda" and snap.to("cpu").k.device.type == "cpu"
    cache.fork(a, b)
    write(cache, b, 14, seed=3)
    cache.restore(c, snap.to("cpu"))
    assert same(view(cache, c), view(cache, a))
    cache.restore(c, snap)
    assert not same(view(cache, c), kept) and cache.token_indices(a, 0, 9).device.type == "cuda"


# ---- isolation -------------------------------------------------------------------------------------
OPS = {
    "reserve": lambda c, s: c.reserve(s, c.seq_len(s) + 6),
    "write": lambda c, s: write(c, s, c.seq_len(s) + 3, seed=9),
    "commit": lambda c, s: (c.reserve(s, c.seq_len(s) + 2), c.commit(s, c.seq_len(s) + 2)),
    "truncate": lambda c, s: c.truncate(s, c.seq_len(s) // 2),
    "reset": lambda c, s: c.reset(s),
    "release": lambda c, s: c.release(s),
    "snapshot": lambda c, s: c.snapshot(s),
    "restore": lambda c, s: c.restore(s, c.snapshot(3 if s != 3 else 0)),
    "fork_into": lambda c, s: c.fork(3 if s != 3 else 0, s),
    "fork_from": lambda c, s: c.fork(s, 2 if s != 2 else 0),
    "token_indices": lambda c, s: c.token_indices(s, 0, c.seq_len(s)),
}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("slot", [0, 1, 3])
def test_operation_on_one_slot_leaves_others_unchanged(op, slot):
    cache = filled()
    if op == "fork_from":  # the fork's destination legitimately changes; keep it out of the comparison
        protected = [s for s in range(4) if s not in (slot, 2 if slot != 2 else 0)]
    else:
        protected = [s for s in range(4) if s != slot]
    before = {s: view(cache, s) for s in protected}
    OPS[op](cache, slot)
    for s in protected:
        assert same(view(cache, s), before[s]), f"{op} on slot {slot} changed slot {s}"
    # A later write into the acted-on slot must not leak either.
    if op != "release":
        write(cache, slot, cache.seq_len(slot) + 5, seed=11)
        for s in protected:
            assert same(view(cache, s), before[s]), f"write after {op} on slot {slot} changed slot {s}"
