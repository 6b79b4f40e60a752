"""K/V pools behind the hybrid cache: every format stores, gathers, forks and snapshots through one interface."""
from __future__ import annotations

import pytest
import torch

from hf2q.cache.hybrid import CacheSnapshot, HybridCache, kv_bytes_per_token
from hf2q.kv_codec import Fp8Codec, TurboQuantCodec
from hf2q.cache.kv_pool import KV_FORMATS, CompressedKVPool, DenseKVPool, format_identity, kv_cache_format
from hf2q.cache.prefix_store import PrefixStore, fingerprint
from hf2q.config import CacheConfig, ModelConfig

# A full-attention shape with a 64-channel head, so the codecs work at a realistic vector length.
MC = ModelConfig(
    arch="qwen35", hidden_size=32, num_layers=4, num_mtp_layers=0, num_heads=4, num_kv_heads=2, head_dim=64,
    rms_norm_eps=1e-6, context_length=256, rope_theta=1e7, rotary_dim=16, rope_sections=(1, 1, 0, 0),
    full_attention_interval=2, linear_num_k_heads=2, linear_num_v_heads=4, linear_k_head_dim=4,
    linear_v_head_dim=6, conv_kernel=4, vocab_size=100, intermediate_size=64,
)


def cache_of(fmt: str) -> HybridCache:
    return HybridCache(MC, CacheConfig(num_slots=3, num_blocks=12, block_size=4, kv_dtype=fmt))


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, MC.num_kv_heads, MC.head_dim, generator=g),
            torch.randn(n, MC.num_kv_heads, MC.head_dim, generator=g) + 0.5)


def codec_of(fmt: str):
    return Fp8Codec(MC.head_dim) if fmt == "fp8" else TurboQuantCodec(MC.head_dim, int(fmt[2:]))


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_store_then_gather_is_the_codec_round_trip(fmt):
    cache = cache_of(fmt)
    slot = cache.acquire()
    cache.reserve(slot, 7)
    k, v = kv(7, 0)
    rows = cache.token_indices(slot, 0, 7)
    cache.kv.store(1, rows, k, v)
    got_k, got_v = cache.kv.gather(1, rows, torch.float32)
    if fmt in ("float32", "bfloat16", "float16"):
        assert isinstance(cache.kv, DenseKVPool)
        torch.testing.assert_close(got_k, k.to(getattr(torch, fmt)).float(), rtol=0, atol=0)
        return
    assert isinstance(cache.kv, CompressedKVPool) and cache.kv.k.dtype == torch.uint8
    codec = codec_of(fmt)
    assert torch.equal(got_k, codec.decode(*codec.encode(k)))
    assert torch.equal(got_v, codec.decode(*codec.encode(v)))
    # the other layer and the rest of the pool were not written
    assert not cache.kv.k_layers[0].any() and cache.kv.rows(1)[0].flatten(1).any(1).sum().item() == 7
    assert not cache.kv.k_side[0].any() and cache.kv.sides(1)[0].ne(0).any(1).sum().item() == 7


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_bytes_per_token_and_held_bytes_match_the_formula(fmt):
    """Bytes per vector: fp8 head_dim + 1 (the scale exponent), TurboQuant head_dim + 4 (the fp32 norm), dense
    head_dim values; payload rows are head_dim bytes or values, 16-byte aligned."""
    cache = cache_of(fmt)
    side = {"fp8": 1, "tq8": 4, "tq6": 4, "tq5": 4}
    row = MC.head_dim + side[fmt] if fmt in side else MC.head_dim * getattr(torch, fmt).itemsize
    per_token = MC.num_kv_layers * 2 * MC.num_kv_heads * row
    assert cache.bytes_per_token == kv_bytes_per_token(MC, fmt) == per_token
    held = sum(t.numel() * t.element_size() for t in cache.kv.planes)
    assert held == per_token * cache.num_blocks * cache.block_size
    assert len(cache.kv.planes) == (4 if fmt in side else 2)
    for layer in range(MC.num_kv_layers):
        for rows in cache.kv.rows(layer):
            assert rows.shape[1:] == (MC.num_kv_heads, MC.head_dim) and rows.is_contiguous()
            assert rows.data_ptr() % 16 == 0 and rows.stride(1) * rows.element_size() % 16 == 0


@pytest.mark.parametrize("fmt", ["tq8", "fp8"])
def test_fork_and_snapshot_move_compressed_rows_unchanged(fmt):
    cache = cache_of(fmt)
    a = cache.acquire()
    cache.reserve(a, 6)
    k, v = kv(6, 1)
    for layer in range(MC.num_kv_layers):
        cache.kv.store(layer, cache.token_indices(a, 0, 6), k, v)
    cache.commit(a, 6)
    snap = cache.snapshot(a)
    assert snap.k.dtype == torch.uint8 and snap.k.shape == (MC.num_kv_layers, 6, MC.num_kv_heads, MC.head_dim)
    side = torch.uint8 if fmt == "fp8" else torch.float32
    assert snap.k_side.dtype == snap.v_side.dtype == side
    assert snap.k_side.shape == (MC.num_kv_layers, 6, MC.num_kv_heads)
    b = cache.acquire()
    cache.fork(a, b)
    c = cache.acquire()
    cache.restore(c, snap)
    want = cache.kv.gather(0, cache.token_indices(a, 0, 6), torch.float32)
    for slot in (b, c):
        got = cache.kv.gather(0, cache.token_indices(slot, 0, 6), torch.float32)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    # a write to the fork's partial block stays in the fork
    cache.reserve(b, 7)
    cache.kv.store(0, cache.token_indices(b, 6, 7), *kv(1, 2))
    assert all(torch.equal(x, y) for x, y in zip(cache.kv.gather(0, cache.token_indices(a, 0, 6), torch.float32),
                                                  want))


def test_snapshots_do_not_cross_between_dense_and_compressed():
    dense, tq = cache_of("float32"), cache_of("tq8")
    s, t = dense.acquire(), tq.acquire()
    dense.reserve(s, 2)
    dense.commit(s, 2)
    with pytest.raises(ValueError, match="snapshot K/V"):
        tq.restore(t, dense.snapshot(s))


def test_format_identity_names_the_codec_tables():
    prints = {format_identity(f) for f in KV_FORMATS}
    assert len(prints) == len(KV_FORMATS)
    assert format_identity("tq8").endswith(TurboQuantCodec(8, 8).fingerprint)
    with pytest.raises(ValueError, match="unknown K/V cache format 'int4'"):
        cache_of("int4")


def test_kv_cache_dtype_flag_names_a_pool_format():
    assert kv_cache_format("auto", "bfloat16") == "bfloat16"
    assert [kv_cache_format(f, "float32") for f in ("fp32", "bf16", "fp16", "fp8", "tq8", "tq6", "tq5")] == [
        "float32", "bfloat16", "float16", "fp8", "tq8", "tq6", "tq5"]
    with pytest.raises(ValueError, match="unknown K/V cache format"):
        kv_cache_format("q4_0", "float32")


def test_checkpoint_files_of_another_kv_format_are_a_miss(tmp_path, gguf_dense_f32):
    """The disk fingerprint carries the format, codebook width and sign/codebook digests: a file written with tq8
    K/V is not read by a server storing tq6 or fp8 rows of the same shape, and is read back under tq8."""
    prints = {f: fingerprint(gguf_dense_f32, "t", CacheConfig(kv_dtype=f), "cpu") for f in KV_FORMATS}
    assert len(set(prints.values())) == len(KV_FORMATS)
    assert "bits=8" in format_identity("tq8") and "signs=" in format_identity("tq8")
    cache = cache_of("tq8")
    slot = cache.acquire()
    cache.reserve(slot, 5)
    cache.kv.store(0, cache.token_indices(slot, 0, 5), *kv(5, 3))
    cache.commit(slot, 5)
    writer = PrefixStore(tmp_path, 1 << 30, prints["tq8"])
    writer.put((1, 2, 3, 4, 5), cache.snapshot(slot))
    writer.flush()
    for fmt in ("tq6", "fp8"):
        assert PrefixStore(tmp_path, 1 << 30, prints[fmt]).lookup([1, 2, 3, 4, 5, 6]) is None
    same = PrefixStore(tmp_path, 1 << 30, prints["tq8"])
    assert same.lookup([1, 2, 3, 4, 5, 6]) == (1, 2, 3, 4, 5)
    loaded, want = same.load((1, 2, 3, 4, 5)), cache.snapshot(slot)
    assert all(torch.equal(a, b) for a, b in zip(loaded.kv_planes, want.kv_planes)) and len(loaded.kv_planes) == 4
    other = cache.acquire()
    cache.restore(other, loaded)
    assert all(torch.equal(a, b) for a, b in zip(cache.kv.gather(0, cache.token_indices(other, 0, 5), torch.float32),
                                                  cache.kv.gather(0, cache.token_indices(slot, 0, 5), torch.float32)))


def test_checkpoints_of_the_previous_layout_are_a_miss(tmp_path, gguf_dense_f32, monkeypatch):
    """A checkpoint written before side values had their own plane (file format 1) or before fp8's scale became a
    power of two (identity of the amax/448 rule) carries another fingerprint: a miss, not a misread."""
    from hf2q import kv_codec
    from hf2q.cache import prefix_store
    new = {f: fingerprint(gguf_dense_f32, "t", CacheConfig(kv_dtype=f), "cpu") for f in ("fp8", "tq8")}
    old_fp8 = kv_codec._digest(f"fp8_e4m3fn:8:amax/{kv_codec.FP8_MAX}".encode())
    assert format_identity("fp8") != old_fp8
    monkeypatch.setattr(prefix_store, "format_identity", lambda fmt: old_fp8 if fmt == "fp8" else format_identity(fmt))
    monkeypatch.setattr(prefix_store, "FORMAT_VERSION", "1")
    for fmt in ("fp8", "tq8"):  # written and read back as the previous version did
        old = fingerprint(gguf_dense_f32, "t", CacheConfig(kv_dtype=fmt), "cpu")
        writer = PrefixStore(tmp_path / fmt, 1 << 30, old)
        writer.put((1, 2, 3), CacheSnapshot(3, *(torch.zeros(1, 3, 2, 68, dtype=torch.uint8) for _ in range(2)),
                                            torch.zeros(1), torch.zeros(1)))
        writer.flush()
        assert old != new[fmt] and PrefixStore(tmp_path / fmt, 1 << 30, old).lookup([1, 2, 3, 4]) == (1, 2, 3)
    monkeypatch.undo()
    for fmt in ("fp8", "tq8"):
        assert PrefixStore(tmp_path / fmt, 1 << 30, new[fmt]).lookup([1, 2, 3, 4]) is None
