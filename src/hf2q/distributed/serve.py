"""`hf2q serve --tensor-parallel-size N`: the serve process is rank 0 and spawns ranks 1..N-1.

Rank 0 owns the scheduler and the HTTP server and broadcasts each step's batch (`TPEngine`); the other
ranks run `serve_worker`. Step messages travel on a CPU (gloo) control group, so idle workers wait on a
socket rather than on a GPU; the model's own collectives use the world group (gloo on CPU, NCCL on CUDA,
one device per rank, `cuda:rank`). Workers exit when rank 0 closes the group or when rank 0 dies.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf2q import envs
from hf2q.distributed.engine import TPEngine, serve_worker
from hf2q.distributed.launch import free_port
from hf2q.distributed.plan import plan_rank
from hf2q.distributed.sharding import shard_model
from hf2q.engine.async_engine import AsyncEngine
from hf2q.engine.engine import EngineConfig
from hf2q.model import Model

log = logging.getLogger("hf2q.tp")

SETUP_TIMEOUT = datetime.timedelta(minutes=10)  # also bounds one model collective
IDLE_TIMEOUT = datetime.timedelta(days=365)  # workers wait on the control group as long as the server idles
STOP_GRACE_S = 10


@dataclass(frozen=True)
class TPLaunch:
    """What a worker needs to load and shard the same model as rank 0."""

    world: int
    path: str
    device_type: str
    dtype: torch.dtype
    keep_quantized: bool | None
    port: int = 0  # chosen by TPWorkers


def check_tensor_parallel(path: str | Path, world: int, device: torch.device) -> None:
    """Fail before loading (ValueError, a clear message) when `world` ranks cannot serve this model here."""
    from hf2q.checkpoint.gguf_file import GGUFFile
    from hf2q.config import ModelConfig

    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {world}")
    if world == 1:
        return
    cfg = ModelConfig.from_gguf_metadata(GGUFFile(path).metadata)
    for rank in range(world):
        plan_rank(cfg, rank, world)  # ShardingError (a ValueError) names the count that does not split
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(f"--tensor-parallel-size {world} puts rank r on cuda:r; use --device cuda, "
                             f"not {device} (select GPUs with CUDA_VISIBLE_DEVICES)")
        found = torch.cuda.device_count()
        if found < world:
            raise ValueError(f"--tensor-parallel-size {world} needs {world} GPUs, but {found} are visible")


class TPWorkers:
    """Ranks 1..N-1, spawned before rank 0 loads its model so that every rank loads at the same time."""

    def __init__(self, launch: TPLaunch):
        self.launch = dataclasses.replace(launch, port=free_port())
        if launch.device_type == "cuda":
            envs.disable_nccl_nvls()  # before spawning: the workers inherit it
        else:
            _share_cpu(launch.world)
        ctx = mp.start_processes(_worker, args=(self.launch, os.getpid()), nprocs=launch.world - 1, join=False,
                                 start_method="spawn")
        self.processes = list(ctx.processes)
        atexit.register(self.stop, 0)  # runs before multiprocessing joins its children at exit

    def start_engine(self, model: Model, config: EngineConfig) -> TPAsyncEngine:
        """Join the group as rank 0, send the engine config, and wrap rank 0's TPEngine (not yet started)."""
        try:
            world, control = self._join()
            local = shard_model(model, 0, self.launch.world, world)  # a cut that splits a block fails before
            dist.broadcast_object_list([config], src=0, group=control)  # any worker shards
            engine = TPEngine(local, config, control)
        except BaseException:
            self.stop(0)
            raise
        log.info("tensor parallel: %d ranks (%s)", self.launch.world, _backend(self.launch.device_type))
        return TPAsyncEngine(engine, self)

    def _join(self):
        """Rank 0's `_join`, failing at once if a worker dies while the others wait for it."""
        result: list = []
        t = threading.Thread(target=lambda: result.append(_safe(_join, 0, self.launch)), daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.5)
            dead = [p.exitcode for p in self.processes if p.exitcode is not None]
            if dead and t.is_alive():
                raise RuntimeError(f"a tensor-parallel worker exited with code {dead[0]} during startup")
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Wait up to `grace_s` for the workers to exit, then terminate what is left."""
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                if grace_s:
                    log.warning("tensor-parallel worker %d did not exit; terminating it", p.pid)
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


class TPAsyncEngine(AsyncEngine):
    """AsyncEngine over rank 0's TPEngine; shutting down also releases and reaps the worker ranks."""

    def __init__(self, engine: TPEngine, workers: TPWorkers):
        super().__init__(engine)
        self.workers = workers
        self._closed = False
        atexit.register(self.shutdown)  # registered after the workers' own: runs first

    def start(self) -> None:
        super().start()
        threading.Thread(target=self._watch_workers, name="hf2q-tp-watch", daemon=True).start()

    def _watch_workers(self) -> None:
        """A dead rank fails every later step: stop serving (as on SIGTERM) instead of reporting healthy."""
        while not self._closed:
            dead = [(i + 1, p.exitcode) for i, p in enumerate(self.workers.processes) if p.exitcode is not None]
            if dead:
                log.error("tensor-parallel rank %d exited (code %s); shutting the server down", *dead[0])
                self.failure = f"tensor-parallel rank {dead[0][0]} exited"  # the server then exits non-zero
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(1)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.ident is not None:
            super().shutdown()
        workers_alive = all(p.is_alive() for p in self.workers.processes)
        if workers_alive and not self._thread.is_alive():  # no step in flight: the group is free to close
            try:
                self.engine.close()
            except Exception:
                log.exception("could not release the tensor-parallel workers")
        self.workers.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker(index: int, launch: TPLaunch, parent_pid: int) -> None:
    import hf2q

    rank = index + 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches every rank; rank 0 decides
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if launch.device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        _share_cpu(launch.world)
    model = hf2q.load(launch.path, device=device, dtype=launch.dtype, keep_quantized=launch.keep_quantized)
    world, control = _join(rank, launch)
    try:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        serve_worker(shard_model(model, rank, launch.world, world), box[0], control)
    finally:
        dist.destroy_process_group()


def _join(rank: int, launch: TPLaunch):
    """(world group, control group) of this rank."""
    dist.init_process_group(_backend(launch.device_type), init_method=f"tcp://127.0.0.1:{launch.port}",
                            rank=rank, world_size=launch.world, timeout=SETUP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return dist.group.WORLD, control


def _safe(fn, *args):
    try:
        return fn(*args)
    except BaseException as exc:
        return exc


def _exit_with_parent(parent_pid: int) -> None:
    """A worker must never outlive rank 0 (killed rank 0 cannot release it)."""
    while os.getppid() == parent_pid:
        time.sleep(1)
    os._exit(1)


def _share_cpu(world: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"
