"""The prefix registry's bookkeeping: longest strict-prefix lookup, data that outlives its slot, the budget."""
from __future__ import annotations

import torch

from hf2q.cache.hybrid import HybridCache
from hf2q.cache.prefix_cache import PrefixCache
from hf2q.config import CacheConfig
from tests.distributed.test_replay import MC

CC = CacheConfig(num_slots=3, num_blocks=16, block_size=4)


def filled(cache: HybridCache, n: int, value: float) -> int:
    """A slot holding n tokens whose K and DeltaNet state are all `value`."""
    slot = cache.acquire()
    cache.reserve(slot, n)
    cache.kv.k_layers[0].view(-1, MC.num_kv_heads, MC.head_dim)[cache.token_indices(slot, 0, n)] = value
    cache.recurrent_state[0][slot].fill_(value)
    cache.commit(slot, n)
    return slot


def test_lookup_takes_the_longest_checkpoint_the_prompt_strictly_extends():
    cache = HybridCache(MC, CC)
    prefix = PrefixCache(cache, 1 << 30)
    a, b = filled(cache, 3, 1.0), filled(cache, 6, 2.0)
    prefix.store(a, [1, 2, 3])
    prefix.store(b, [1, 2, 3, 4, 5, 6])
    assert len(prefix.lookup([1, 2, 3, 4, 5, 6, 7]).tokens) == 6
    assert len(prefix.lookup([1, 2, 3, 4, 5, 6]).tokens) == 3  # a whole prompt must leave a token to compute
    assert prefix.lookup([1, 2, 9, 4]) is None and prefix.lookup([1, 2, 3]) is None


def test_a_checkpoint_outlives_its_slot_and_resumes_exactly():
    cache = HybridCache(MC, CC)
    prefix = PrefixCache(cache, 1 << 30)
    slot = filled(cache, 6, 5.0)
    prefix.store(slot, list(range(6)))
    cache.release(slot)
    filled(cache, 16, -1.0)  # reuses every free block
    new = cache.acquire()
    assert prefix.adopt(prefix.lookup(list(range(7))), new) == 6
    k = cache.kv.k_layers[0].view(-1, MC.num_kv_heads, MC.head_dim)[cache.token_indices(new, 0, 6)]
    assert torch.all(k == 5.0) and torch.all(cache.recurrent_state[0][new] == 5.0)


def test_the_budget_evicts_least_recently_used_first():
    cache = HybridCache(MC, CC)
    slots = [filled(cache, 4, float(i)) for i in range(3)]
    one = cache.bytes_per_token * 4 + cache.fixed_bytes_per_slot  # one full block and one state
    prefix = PrefixCache(cache, 2 * one)
    prefix.store(slots[0], [0] * 4)
    prefix.store(slots[1], [1] * 4)
    prefix.store(slots[0], [0] * 4)  # already held: only made the most recent
    prefix.store(slots[2], [2] * 4)
    assert prefix.lookup([1] * 5) is None and prefix.lookup([0] * 5) and prefix.lookup([2] * 5)
    assert prefix.stats.evictions == 1 and prefix.nbytes == 2 * one
