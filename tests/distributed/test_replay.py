"""Rank 0's logged slot operations, replayed on another cache, give the same K/V layout."""
from __future__ import annotations

import random

import pytest

from hf2q.cache.hybrid import CacheFull, HybridCache, NoFreeSlot
from hf2q.config import CacheConfig, ModelConfig
from hf2q.distributed.engine import RecordingCache, replay
from hf2q.distributed.shard_store import ShardFiles

MC = ModelConfig(arch="qwen35", hidden_size=8, num_layers=4, num_mtp_layers=0, num_heads=2, num_kv_heads=1,
                 head_dim=4, rms_norm_eps=1e-6, context_length=64, rope_theta=1e4, rotary_dim=4,
                 rope_sections=(1, 1, 0, 0), full_attention_interval=4, linear_num_k_heads=1,
                 linear_num_v_heads=2, linear_k_head_dim=4, linear_v_head_dim=4, conv_kernel=4, vocab_size=16,
                 intermediate_size=8)
CC = CacheConfig(num_slots=4, num_blocks=12, block_size=4)


def recording() -> RecordingCache:
    return RecordingCache(MC, CC)


def test_random_slot_operations_replay_to_the_same_layout():
    rng = random.Random(0)
    leader, follower = recording(), HybridCache(MC, CC)
    live: list[int] = []
    kept: list[str] = []
    for i in range(300):
        op = rng.choice(["acquire", "reserve", "commit", "release", "truncate", "fork", "retain", "resume", "drop"])
        try:
            if op == "acquire":
                live.append(leader.acquire())
            elif live and op == "reserve":
                s = rng.choice(live)
                leader.reserve(s, leader.seq_len(s) + rng.randrange(1, 9))
            elif live and op == "commit":
                s = rng.choice(live)
                leader.commit(s, rng.randrange(leader.seq_len(s), leader.blocks.num_tokens(s) + 1))
            elif live and op == "release":
                s = live.pop(rng.randrange(len(live)))
                leader.release(s)
            elif live and op == "truncate":
                s = rng.choice(live)
                leader.truncate(s, rng.randrange(0, leader.seq_len(s) + 1))
            elif len(live) >= 2 and op == "fork":
                src, dst = rng.sample(live, 2)
                leader.fork(src, dst)
            elif live and op == "retain":
                leader.retain(rng.choice(live), f"k{i}")
                kept.append(f"k{i}")
            elif live and kept and op == "resume":
                leader.resume(rng.choice(kept), rng.choice(live))
            elif kept and op == "drop":
                leader.drop(kept.pop(rng.randrange(len(kept))))
        except (CacheFull, NoFreeSlot):
            pass
        replay(follower, leader.drain())
        for s in live:
            assert follower.block_table(s) == leader.block_table(s)
            assert follower.seq_len(s) == leader.seq_len(s)
    assert follower.num_free_slots == leader.num_free_slots
    assert [follower.retained_blocks(k) for k in kept] == [leader.retained_blocks(k) for k in kept]


def test_a_restore_this_rank_has_not_loaded_fails_loudly():
    """A rank restores only the shard it loaded when rank 0 asked (`ShardFiles.answer`): one it does not hold
    means the ranks diverged, and computing on would give wrong answers."""
    leader, follower = recording(), HybridCache(MC, CC)
    slot = leader.acquire()
    leader.restore(slot, leader.snapshot(slot))
    with pytest.raises(RuntimeError, match="diverged"):
        replay(follower, leader.drain(), ShardFiles(None, None))
