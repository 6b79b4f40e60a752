"""Prefix checkpoints on disk: a new engine on the same model and directory resumes from them with tokens
identical to a cold run, and any bad file or unwritable directory is a miss, never a failure."""
from __future__ import annotations

import json
import logging
import os
import stat
import struct

import pytest
import torch

import hf2q
from hf2q.cache.hybrid import CacheSnapshot
from hf2q.cache.prefix_store import PrefixStore
from hf2q.config import CacheConfig
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [1000 + (i * 37) % 5000 for i in range(40)]


@pytest.fixture(scope="module")
def model(gguf_dense_f32):
    return hf2q.load(gguf_dense_f32)


def make_engine(model, directory=None, prefix_bytes=1 << 30, disk_bytes=1 << 30, state_dtype="float32") -> Engine:
    return Engine(model, EngineConfig(
        max_model_len=512, scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=128, prefill_chunk=64),
        cache=CacheConfig(num_slots=2, num_blocks=256, block_size=8, state_dtype=state_dtype,
                          prefix_cache_bytes=prefix_bytes, prefix_checkpoint_stride=0,
                          prefix_cache_dir=None if directory is None else str(directory),
                          prefix_cache_disk_bytes=disk_bytes)))


def run(engine, prompt, rid) -> tuple[list[int], int]:
    engine.add_request(prompt, GREEDY, request_id=rid)
    toks, cached = [], 0
    while engine.has_work():
        for o in engine.step():
            toks += o.new_token_ids
            cached = max(cached, o.num_cached_tokens)
    return toks, cached


@pytest.fixture(scope="module")
def cold(model):
    """The first turn, its follow-up and the follow-up's tokens with the prefix cache off."""
    off = make_engine(model, prefix_bytes=0)
    first, _ = run(off, PROMPT, "a")
    follow = PROMPT + first + [5, 6, 7]
    return first, follow, run(off, follow, "b")[0]


def write_checkpoint(model, directory):
    """An engine that takes one checkpoint (the finished first turn) and writes it."""
    engine = make_engine(model, directory)
    run(engine, PROMPT, "a")
    engine.prefix.disk.flush()
    return engine


def test_a_restarted_engine_resumes_from_disk(model, cold, tmp_path):
    first, follow, want = cold
    write_checkpoint(model, tmp_path / "store")
    engine = make_engine(model, tmp_path / "store")  # same model, same directory: a restart
    assert len(engine.prefix) == 0 and len(engine.prefix.disk) == 1
    got, cached = run(engine, follow, "b")
    assert got == want and cached == len(PROMPT) + len(first) - 1
    assert engine.prefix.stats.hits == 1 and len(engine.prefix) >= 1  # loaded into memory on the first hit
    again, cached = run(engine, follow, "c")  # now resumed from memory (a longer checkpoint, from "b")
    assert again == want and cached > len(PROMPT)


def test_files_are_private(model, tmp_path):
    directory = tmp_path / "a" / "b"
    write_checkpoint(model, directory)
    files = list(directory.glob("*.safetensors"))
    assert len(files) == 1 and not list(directory.glob("*.tmp"))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600


def _flip_k(path):
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    start, end = json.loads(data[8:8 + n])["k"]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", ["flip", "truncate", "fingerprint"])
def test_a_bad_file_is_a_logged_miss(model, cold, tmp_path, caplog, damage):
    _, follow, want = cold
    directory = tmp_path / "store"
    write_checkpoint(model, directory)
    (path,) = directory.glob("*.safetensors")
    if damage == "flip":
        _flip_k(path)
    elif damage == "truncate":
        _truncate(path)
    else:  # the same file written by another model
        other = PrefixStore(tmp_path / "other", 1 << 30, "another-model")
        other.put(tuple(PROMPT), CacheSnapshot(len(PROMPT), *(torch.zeros(1) for _ in range(4))))
        other.flush()
        path.unlink()
        next((tmp_path / "other").glob("*.safetensors")).rename(path)
    with caplog.at_level(logging.INFO, logger="hf2q.cache.prefix_store"):
        engine = make_engine(model, directory)
        got, cached = run(engine, follow, "b")
    assert got == want and cached == 0
    assert sum(path.name in r.getMessage() for r in caplog.records) == 1


def test_a_checkpoint_of_another_state_dtype_is_a_miss(model, cold, tmp_path, caplog):
    """A checkpoint written with an fp32 DeltaNet state is not resumed by a server keeping it in bf16 (a logged
    miss: the fingerprint names the state dtype), whose own checkpoint a restart with bf16 then resumes, with the
    tokens of a cold bf16 run."""
    first, follow, _ = cold
    directory = tmp_path / "store"
    write_checkpoint(model, directory)
    (path,) = directory.glob("*.safetensors")
    want, _ = run(make_engine(model, prefix_bytes=0, state_dtype="bfloat16"), follow, "b")
    with caplog.at_level(logging.INFO, logger="hf2q.cache.prefix_store"):
        engine = make_engine(model, directory, state_dtype="bfloat16")
        got, cached = run(engine, follow, "b")
        engine.prefix.disk.flush()
    assert got == want and cached == 0
    assert sum(path.name in r.getMessage() for r in caplog.records) == 1
    longer = follow + want + [8]
    again, cached = run(make_engine(model, directory, state_dtype="bfloat16"), longer, "c")
    assert cached >= len(follow) + len(want) - 1
    assert again == run(make_engine(model, prefix_bytes=0, state_dtype="bfloat16"), longer, "c")[0]


def test_an_unwritable_directory_never_fails_a_request(model, cold, tmp_path, caplog):
    first, follow, want = cold
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="hf2q.cache.prefix_store"):
        engine = make_engine(model, blocker / "store")
        assert run(engine, PROMPT, "a")[0] == first
        engine.prefix.disk.flush()
        got, cached = run(engine, follow, "b")
        assert got == want and cached > 0  # the in-memory cache still works
        engine.prefix.disk.flush()
    assert any("cannot write" in r.getMessage() for r in caplog.records)
    if os.geteuid() != 0:  # root writes to read-only directories anyway
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        engine = make_engine(model, ro)
        assert run(engine, PROMPT, "a")[0] == first
        engine.prefix.disk.flush()


def test_disk_budget_evicts_least_recently_used(tmp_path):
    snap = CacheSnapshot(4, torch.ones(2, 4, 1, 64), torch.ones(2, 4, 1, 64), torch.ones(1, 2, 8),
                         torch.ones(1, 2, 4, 4))
    probe = PrefixStore(tmp_path / "probe", 1 << 30, "fp")
    probe.put((1, 2, 3, 4), snap)
    probe.flush()
    size = next((tmp_path / "probe").glob("*.safetensors")).stat().st_size
    store = PrefixStore(tmp_path / "s", int(2.5 * size), "fp")
    keys = [(i, 2, 3, 4) for i in range(3)]
    for key in keys[:2]:
        store.put(key, snap)
        store.flush()
    assert store.load(keys[0]) is not None  # now the most recently used
    store.put(keys[2], snap)
    store.flush()
    assert len(store) == 2 and store.lookup(list(keys[1]) + [5]) is None
    assert store.lookup(list(keys[0]) + [5]) == keys[0] and len(list((tmp_path / "s").iterdir())) == 2
    assert len(PrefixStore(tmp_path / "s", int(2.5 * size), "fp")) == 2  # a restart reads the same index


def test_serve_flags_reach_the_cache_config(tmp_path):
    import argparse

    from hf2q.server.launch import add_serve_args, with_prefix_cache

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk-gb", "0.5"])
    cc = with_prefix_cache(CacheConfig(), args, 1 << 20)
    assert cc.prefix_cache_dir == str(tmp_path) and cc.prefix_cache_disk_bytes == 1 << 29
    assert with_prefix_cache(CacheConfig(), p.parse_args([]), 1 << 20).prefix_cache_dir is None


def test_a_full_disk_never_fails_a_request(model, cold, tmp_path, caplog, monkeypatch):
    import errno

    import hf2q.cache.prefix_store as prefix_store

    first, follow, want = cold

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prefix_store.os, "fsync", no_space)
    with caplog.at_level(logging.WARNING, logger="hf2q.cache.prefix_store"):
        engine = make_engine(model, tmp_path / "full")
        assert run(engine, PROMPT, "a")[0] == first
        engine.prefix.disk.flush()
        got, cached = run(engine, follow, "b")
        engine.prefix.disk.flush()
    assert got == want and cached > 0  # the in-memory cache still works
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1
    assert not list((tmp_path / "full").iterdir())  # no partial file left behind
    monkeypatch.undo()
    assert run(make_engine(model, tmp_path / "full"), follow, "c") == (want, 0)  # after a restart: a miss


# A writer that stops for good inside its checkpoint write, after the data and before the rename.
_STALLED_WRITER = """
import os, sys, time, torch
import hf2q.cache.prefix_store as ps
def stall(fd):
    print("writing", flush=True)
    time.sleep(600)
ps.os.fsync = stall
store = ps.PrefixStore(sys.argv[1], 1 << 34, "fp")
store.put(tuple(range(4096)), ps.CacheSnapshot(4096, torch.ones(2, 4096, 2, 256), torch.ones(2, 4096, 2, 256),
                                               torch.ones(1, 2, 8), torch.ones(1, 2, 4, 4)))
time.sleep(600)
"""


def test_kill_9_during_a_write_leaves_no_state_that_is_used(tmp_path, caplog):
    import subprocess
    import sys

    directory = tmp_path / "store"
    writer = subprocess.Popen([sys.executable, "-c", _STALLED_WRITER, str(directory)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        (partial,) = directory.glob(".*.tmp")
        assert partial.stat().st_size > 1 << 20  # the checkpoint's data, never renamed
    finally:
        writer.kill()  # SIGKILL: no cleanup runs
        writer.wait()
    with caplog.at_level(logging.INFO, logger="hf2q.cache.prefix_store"):
        store = PrefixStore(directory, 1 << 30, "fp")
    assert len(store) == 0 and store.lookup(list(range(5000))) is None
    assert not list(directory.iterdir())  # the orphan is gone
    assert sum("interrupted write" in r.getMessage() for r in caplog.records) == 1
