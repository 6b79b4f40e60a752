"""Prefix checkpoints on disk under tensor parallelism (2 gloo ranks on CPU): each rank writes its shard, a
restarted group resumes from them with one device's tokens, and a bad or missing shard of rank 1 is a miss for
every rank with one log line."""
from __future__ import annotations

import json
import logging
import stat
import struct

import pytest
import torch
import torch.distributed as dist

from hf2q.cache.hybrid import CacheSnapshot
from hf2q.cache.prefix_store import file_name
from hf2q.config import CacheConfig
from hf2q.distributed.engine import TPEngine, serve_worker
from hf2q.distributed.launch import run_ranks
from hf2q.distributed.sharding import shard_model
from hf2q.distributed.shard_store import ShardedStore, rank_dir
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=True)  # logprobs: a state off by
# a shard shows even where the tiny model's argmax does not
PROMPT = [1000 + (i * 37) % 5000 for i in range(24)]
PHASES = ("write", "restart", "corrupt", "missing")


def config(directory=None, prefix_bytes=1 << 30) -> EngineConfig:
    return EngineConfig(max_model_len=128, scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                                                    prefill_chunk=32),
                        cache=CacheConfig(num_slots=2, num_blocks=64, block_size=4, prefix_cache_bytes=prefix_bytes,
                                          prefix_checkpoint_stride=0, prefix_cache_dir=directory))


def run(engine, prompt) -> tuple[list[tuple[int, float]], int]:
    """(token, logprob) of each generated token, and the prompt tokens resumed from a checkpoint."""
    engine.add_request(prompt, GREEDY, request_id=str(len(engine.requests)))
    toks, cached = [], 0
    while engine.has_work():
        for o in engine.step():
            toks += [(t, lp.logprob) for t, lp in zip(o.new_token_ids, o.logprobs)]
            cached = max(cached, o.num_cached_tokens)
    return toks, cached


def same(got, want) -> bool:
    """Same tokens, logprobs within fp32 rounding (the ranks sum their partial products in another order)."""
    return [t for t, _ in got] == [t for t, _ in want] and all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, want))


@pytest.fixture(scope="module")
def cold(tp_models):
    """The first turn, its follow-up, and the follow-up's tokens on one device without a prefix cache."""
    off = Engine(tp_models["dense"], config(prefix_bytes=0))
    first, _ = run(off, PROMPT)
    follow = PROMPT + [t for t, _ in first] + [5, 6, 7]
    return follow, run(off, follow)[0]


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _damage(directory, follow, phase):
    """Rank 1's shard of the first turn's checkpoint (what the follow-up resumes from), flipped or deleted."""
    shard = rank_dir(directory, 1, 2) / file_name(tuple(follow[:len(PROMPT) + GREEDY.max_tokens - 1]))
    if phase == "missing":
        shard.unlink()
        return
    data = bytearray(shard.read_bytes())  # one byte of K flipped: the header still reads, the checksum does not
    (n,) = struct.unpack("<Q", data[:8])
    start, end = json.loads(data[8:8 + n])["k"]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _rank(rank, world, group, model, follow, directory, result_path):
    torch.set_num_threads(1)
    records = Records()
    logging.getLogger("hf2q").addHandler(records)
    logging.getLogger("hf2q").setLevel(logging.INFO)
    local, results = shard_model(model, rank, world, group), {}
    for phase in PHASES:  # each phase a new engine on the same directory: a restart
        if rank == 0 and phase in ("corrupt", "missing"):
            _damage(directory, follow, phase)
        dist.barrier(group)
        records.lines.clear()
        if rank != 0:
            serve_worker(local, config(directory), group)  # returns once its queued shards are written
        else:
            engine = TPEngine(local, config(directory), group)
            try:
                tokens, cached = run(engine, PROMPT if phase == "write" else follow)
                engine.prefix.disk.flush()
            finally:
                engine.close()
            results[phase] = (tokens, cached, engine.prefix.stats.hits)
        dist.barrier(group)  # every rank's shards are on disk
        results[phase] = results.get(phase, ()) + (list(records.lines),)
    torch.save(results, f"{result_path}.{rank}")


def test_a_restarted_group_resumes_from_every_ranks_shard(tp_models, cold, tmp_path):
    follow, want = cold
    directory = tmp_path / "prefixes"
    run_ranks(_rank, 2, tp_models["dense"], follow, str(directory), str(tmp_path / "results"), start_method="fork",
              timeout_s=120)
    got, workers = torch.load(tmp_path / "results.0"), torch.load(tmp_path / "results.1")
    for path in (directory / "tp2", rank_dir(directory, 0, 2), rank_dir(directory, 1, 2)):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    # two checkpoints (the first turn, the follow-up) on rank 0; rank 1 lost the first in the last phase
    shards = [{p.name: p for p in rank_dir(directory, r, 2).glob("*.safetensors")} for r in (0, 1)]
    assert len(shards[0]) == 2 and len(shards[1]) == 1 and set(shards[1]) < set(shards[0])
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in [*shards[0].values(), *shards[1].values()])
    tokens, cached, hits, _ = got["restart"]
    assert same(tokens, want) and cached == len(PROMPT) + GREEDY.max_tokens - 1 and hits == 1
    for phase in ("corrupt", "missing"):
        tokens, cached, hits, lines = got[phase]
        assert same(tokens, want) and cached == 0 and hits == 0, phase
        assert len([line for line in lines if "rank 1's shard" in line]) == 1, (phase, lines)
        assert not [line for line in workers[phase][0] if "shard" in line or "does not load" in line], phase


def test_evicting_a_checkpoint_removes_every_ranks_shard(tp_models, tmp_path):
    cc = CacheConfig(prefix_cache_dir=str(tmp_path), prefix_cache_disk_bytes=1 << 30)
    store = ShardedStore(tp_models["dense"], cc, None, 2)
    snap = CacheSnapshot(1, *(torch.zeros(1) for _ in range(4)))
    store.put((1,), snap)
    store.flush()
    (first,) = store.dir.glob("*.safetensors")
    peer = rank_dir(tmp_path, 1, 2) / first.name  # rank 1's shard of the same checkpoint
    peer.parent.mkdir(parents=True)
    peer.write_bytes(first.read_bytes())
    store.budget_bytes = first.stat().st_size  # room for one: the next write evicts the first, on both ranks
    store.put((2,), snap)
    store.flush()
    assert not first.exists() and not peer.exists() and len(store) == 1
