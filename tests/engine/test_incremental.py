"""Cache-backed execution equals one-shot execution: incremental decode, chunked prefill, snapshots, forks."""
from __future__ import annotations

import pytest
import torch

import hf2q
from hf2q.cache.hybrid import HybridCache
from hf2q.config import CacheConfig
from hf2q.forward import ForwardBatch

TOKENS = [9707, 11, 1879, 0, 35946, 4340, 220, 16, 17, 18, 248045, 846, 198, 3838, 374, 264, 1273, 30, 5, 77, 1000,
          2000, 3000, 4000]


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    return hf2q.load(request.getfixturevalue(f"gguf_{request.param}_f32"))


def make_cache(model, slots=4, blocks=64, block_size=8) -> HybridCache:
    return HybridCache(model.config, CacheConfig(num_slots=slots, num_blocks=blocks, block_size=block_size))


@torch.inference_mode()
def run(model, cache, slot, tokens) -> torch.Tensor:
    """Feed tokens to a slot after what it already holds; return their logits."""
    start = cache.seq_len(slot)
    cache.reserve(slot, start + len(tokens))
    batch = ForwardBatch.single(tokens, start=start, slot=slot, cache=cache)
    hidden = model.net(batch)
    cache.commit(slot, start + len(tokens))
    return model.net.compute_logits(hidden)


def close(a, b, tol=1e-5) -> bool:
    return float((a - b).abs().max() / b.abs().max()) <= tol


def test_incremental_decode_equals_full_forward(model):
    full = model.logits(TOKENS)
    cache = make_cache(model)
    slot = cache.acquire()
    rows = [run(model, cache, slot, [t])[0] for t in TOKENS]
    for i, row in enumerate(rows):
        assert close(row, full[i]), f"position {i}"


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 16])
def test_chunked_prefill_equals_one_shot(model, chunk):
    full = model.logits(TOKENS)
    cache = make_cache(model)
    slot = cache.acquire()
    out = torch.cat([run(model, cache, slot, TOKENS[i:i + chunk]) for i in range(0, len(TOKENS), chunk)])
    assert close(out, full)


def test_snapshot_restore_gives_same_continuation(model):
    cache = make_cache(model)
    slot = cache.acquire()
    run(model, cache, slot, TOKENS[:10])
    snap = cache.snapshot(slot)
    expected = run(model, cache, slot, TOKENS[10:14])
    run(model, cache, slot, TOKENS[14:20])  # advance further, then go back
    cache.restore(slot, snap)
    assert cache.seq_len(slot) == 10
    assert torch.equal(run(model, cache, slot, TOKENS[10:14]), expected)


def test_fork_gives_independent_slots(model):
    cache = make_cache(model)
    a = cache.acquire()
    run(model, cache, a, TOKENS[:11])
    b = cache.acquire()
    cache.fork(a, b)
    ref_a = model.logits(TOKENS[:11] + [5, 6, 7])[-3:]
    ref_b = model.logits(TOKENS[:11] + [900, 901])[-2:]
    out_b = run(model, cache, b, [900, 901])
    out_a = run(model, cache, a, [5, 6, 7])
    assert close(out_a, ref_a) and close(out_b, ref_b)


def test_reset_of_one_slot_never_changes_another(model):
    cache = make_cache(model)
    a, b = cache.acquire(), cache.acquire()
    run(model, cache, a, TOKENS[:9])
    run(model, cache, b, TOKENS[5:15])
    cache.reset(b)
    run(model, cache, b, [1, 2, 3])
    cache.release(b)
    assert close(run(model, cache, a, TOKENS[9:12]), model.logits(TOKENS[:12])[9:])
