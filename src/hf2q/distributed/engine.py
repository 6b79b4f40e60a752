"""Rank 0 runs the ordinary `Engine` (scheduler, sampler, requests); every step it broadcasts the batch,
and the other ranks run the same forward on their shards.

The ranks' caches must agree on which rows of the K/V pools a position uses. Rather than sending
block tables, rank 0 logs each slot operation of its cache (acquire, reserve, release, ...) and the
other ranks replay the log on their own cache before the forward: the block manager is deterministic,
so the same calls give the same layout. Only token ids, positions and the log cross the wire; K/V and
DeltaNet state never do (with `--prefix-cache-dir`, each rank writes and reads its own shard of a
checkpoint: `hf2q.distributed.shard_store`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf2q.cache.hybrid import CacheSnapshot, HybridCache
from hf2q.config import CacheConfig, ModelConfig
from hf2q.distributed.shard_store import LoadQuery, ShardedStore, ShardFiles, rank_store
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.request import Request, RequestOptions
from hf2q.engine.runner import ModelRunner
from hf2q.forward import ForwardBatch
from hf2q.model import Model

_LOGGED = ("acquire", "release", "reset", "reserve", "commit", "truncate", "fork", "retain", "resume", "drop")
_ON_DISK = ("save", "restore")  # a checkpoint's shard written to, or restored from, this rank's store


class RecordingCache(HybridCache):
    """Rank 0's cache: a HybridCache that also logs its slot operations for the other ranks to replay."""

    # The other ranks' forwards keep no states for rank 0 to retain: an anchor cuts the chunk instead.
    keeps_states_inside_a_chunk = False

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: str | torch.device = "cpu"):
        super().__init__(model_config, cache_config, device)
        self.log: list = []
        self.recording = True

    def record(self, name: str, *args) -> None:
        if self.recording:
            self.log.append((name, args))

    def acquire(self) -> int:
        slot = super().acquire()
        self.record("acquire", slot)
        return slot

    def release(self, slot: int) -> None:
        super().release(slot)
        self.record("release", slot)

    def reset(self, slot: int) -> None:
        super().reset(slot)
        self.record("reset", slot)

    def reserve(self, slot: int, new_len: int) -> None:
        super().reserve(slot, new_len)
        self.record("reserve", slot, new_len)

    def commit(self, slot: int, new_len: int) -> None:
        super().commit(slot, new_len)
        self.record("commit", slot, new_len)

    def truncate(self, slot: int, new_len: int) -> None:
        super().truncate(slot, new_len)
        self.record("truncate", slot, new_len)

    def fork(self, src: int, dst: int) -> None:
        super().fork(src, dst)
        self.record("fork", src, dst)

    def retain(self, slot: int, key: str, n=None, states=None) -> None:  # each rank retains its own shard
        if states is not None:  # never asked: keeps_states_inside_a_chunk is False here
            raise NotImplementedError("the other ranks cannot retain states kept inside a chunk")
        super().retain(slot, key)
        self.record("retain", slot, key)

    def resume(self, key: str, slot: int) -> int:
        n = super().resume(key, slot)
        self.record("resume", key, slot)
        return n

    def drop(self, key: str) -> None:
        super().drop(key)
        self.record("drop", key)

    def restore(self, slot: int, snap: CacheSnapshot) -> None:  # each rank restores the shard it loaded
        super().restore(slot, snap)
        self.record("restore", slot, snap.num_tokens)

    def drain(self) -> list:
        log, self.log = self.log, []
        return log


def replay(cache: HybridCache, log: list, files: ShardFiles | None = None) -> None:
    """Apply rank 0's slot operations to this rank's cache, in order (checkpoint writes and restores through
    `files`)."""
    for name, args in log:
        if name in _ON_DISK and files is not None:
            getattr(files, name)(cache, *args)
        elif name not in _LOGGED:
            raise ValueError(f"unknown cache operation {name!r}")
        elif name == "acquire":
            slot = cache.acquire()
            if slot != args[0]:
                raise RuntimeError(f"cache replay diverged: acquired slot {slot}, rank 0 got {args[0]}")
        else:
            getattr(cache, name)(*args)


@dataclass
class StepMessage:
    """One forward, as rank 0 sends it: cache log, flat batch, and the rows whose logits are wanted."""

    log: list
    input_ids: list[int]
    positions: list[int]
    seq_lens: list[int]
    start_lens: list[int]
    slots: list[int]
    logit_rows: list[int] = field(default_factory=list)


def broadcast(msg: StepMessage | None, group) -> StepMessage | LoadQuery | None:
    box = [msg]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


class TPRunner(ModelRunner):
    """Rank 0's runner: announce the step to the other ranks, then run it like the single-device runner.

    Every step runs eagerly, as on the other ranks: a decode graph would pad the batch to its bucket and
    warm up and capture with collectives that no other rank joins (and take a padding slot unlogged)."""

    def __init__(self, net, cache: RecordingCache, group):
        super().__init__(net, cache, cuda_graphs=False)
        self.group = group

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Request, int]]):
        batch = self.build_batch(scheduled)
        rows, row = [], 0
        for req, n in scheduled:
            row += n
            if req.num_computed + n == req.num_tokens and not req.prefill_only:
                rows.append(row - 1)
        broadcast(StepMessage(self.cache.drain(), batch.input_ids.tolist(), batch.positions.tolist(), batch.seq_lens,
                              batch.start_lens, batch.slots, rows), self.group)
        self.cache.recording = False  # the other ranks do the runner's own reserve / commit themselves
        try:
            return super().run(scheduled)
        finally:
            self.cache.recording = True


class TPEngine(Engine):
    """The engine of rank 0 in a tensor-parallel group; `close()` releases the other ranks."""

    cache_class = RecordingCache

    def __init__(self, model: Model, config: EngineConfig = EngineConfig(), group=None):
        self.group = group
        super().__init__(model, config)
        self.runner = TPRunner(model.net, self.cache, group)
        self.scheduler.graphed_prefill_rows = 0  # the runner replays no graphs
        self.async_scheduling = False  # the other ranks replay steps whose input ids the host knows

    def add_request(self, prompt_ids, params, request_id=None, options: RequestOptions = RequestOptions()):
        # The vocab-parallel head is a collective the other ranks would have to join for every prompt row.
        if options.prompt_logprobs is not None:
            raise ValueError("prompt logprobs (echo with logprobs) are not supported with tensor parallelism")
        if options.images:
            raise ValueError("images are not supported with tensor parallelism")
        return super().add_request(prompt_ids, params, request_id, options)

    def _disk_store(self, model: Model, cc: CacheConfig) -> ShardedStore | None:
        if not cc.prefix_cache_dir:
            return None
        return ShardedStore(model, cc, self.group, dist.get_world_size(self.group))

    def _warm_up(self) -> None:
        """On CUDA, warm_up_requests (the group captures no decode graphs); elsewhere nothing compiles."""
        if self.runner.device.type == "cuda":
            self.warm_up_requests()

    def warm_up_requests(self) -> None:
        """Throwaway requests that every rank steps through together: a whole prefill chunk, then the single-device
        warm-up's prompts."""
        self._warm_up_requests(((self._warm_up_chunk(),),) + self.WARM_UP_PROMPTS)

    def _compile_workers(self) -> int:
        """Each rank compiles on its share of the host's cores."""
        return _compile_workers(self.group)

    def close(self) -> None:
        if self.cache.log:  # operations since the last step (a finished request's checkpoint and release)
            broadcast(StepMessage(self.cache.drain(), [], [], [], [], []), self.group)
        broadcast(None, self.group)


@torch.inference_mode()
def serve_worker(model: Model, config: EngineConfig = EngineConfig(), group=None) -> None:
    """Loop of a rank other than 0: replay, forward, repeat until rank 0 closes. On CUDA its autotuners compile
    their candidates side by side (the first steps are rank 0's warm-up)."""
    if model.device.type == "cuda":
        from hf2q.kernels.tuning.parallel_compile import compile_candidates_in_parallel

        with compile_candidates_in_parallel(_compile_workers(group)):
            return _serve_steps(model, config, group)
    return _serve_steps(model, config, group)


def _compile_workers(group) -> int:
    """Compile threads for one rank: the host's cores shared by the group's ranks (each compiles the same kernels)."""
    return max(1, (os.cpu_count() or 1) // dist.get_world_size(group))


def _serve_steps(model: Model, config: EngineConfig, group) -> None:
    cache = HybridCache(model.config, config.cache, device=model.device)
    net, device = model.net, model.device
    cc = config.cache
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    files = ShardFiles(rank_store(model, cc, rank, world) if cc.prefix_cache_dir and cc.prefix_cache_bytes > 0
                       else None, group)
    while (msg := broadcast(None, group)) is not None:
        if isinstance(msg, LoadQuery):
            files.answer(msg)
            continue
        replay(cache, msg.log, files)
        if not msg.slots:  # only the log, sent by rank 0 on closing
            continue
        for slot, start, n in zip(msg.slots, msg.start_lens, msg.seq_lens):
            cache.reserve(slot, start + n)
        batch = ForwardBatch(torch.tensor(msg.input_ids, dtype=torch.long, device=device),
                             torch.tensor(msg.positions, dtype=torch.long, device=device),
                             msg.seq_lens, msg.start_lens, msg.slots, cache)
        hidden = net(batch)
        for slot, start, n in zip(msg.slots, msg.start_lens, msg.seq_lens):
            cache.commit(slot, start + n)
        if msg.logit_rows:  # the vocab-parallel head is a collective: take part, drop the result
            net.compute_logits(hidden[torch.tensor(msg.logit_rows, device=hidden.device)])
    files.flush()  # rank 0 has closed: the shards still queued reach the disk
