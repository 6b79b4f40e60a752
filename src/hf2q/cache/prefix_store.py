"""The on-disk store of prefix checkpoints, so retained prefixes outlive the process.

One safetensors file per checkpoint: the token ids, the K/V of the prefix as the pool stores it (payloads, and for a
compressed pool its side values) and the DeltaNet conv and recurrent state at its last token, with a header (format
version, model fingerprint, token count, sha256 of the tensors). Files are written by one background thread from a
bounded queue (a full queue drops the write: a checkpoint is an optimisation), to a temp file that is fsynced and
renamed, so a reader sees a whole file or none. A file that does not load, does not match its checksum or comes from
another model is a miss and one log line; a write that fails (full disk, read-only directory) never fails a request.
Under tensor parallelism each rank keeps its own shard of every checkpoint in a store of its own
(`hf2q.distributed.shard_store`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save

from hf2q.cache.hybrid import CacheSnapshot, HybridCache, LinearStates
from hf2q.cache.kv_pool import format_identity
from hf2q.config import CacheConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = "2"  # 2: a compressed pool's side values in their own tensors (k_side, v_side)
_NAMES = ("tokens", "k", "v", "conv", "recurrent")
_SIDES = ("k_side", "v_side")  # present for a compressed pool
_EDGE = 1 << 20  # bytes read at each end of the GGUF for its fingerprint


def fingerprint(model_path: str | os.PathLike, chat_template: str, cache_config: CacheConfig,
                device_type: str, rank: int = 0, world: int = 1) -> str:
    """What makes a saved state valid: the GGUF's identity (size, first and last MiB: header, metadata,
    tensor infos and the tail of the data), the chat template, the cache layout (with the K/V format's codebook
    width, sign table and codebook), the device kind (CUDA
    and CPU kernels round differently), this file format's version and, under tensor parallelism, the group's
    size and this rank (a shard of another split holds other heads)."""
    h = hashlib.sha256()
    size = os.path.getsize(model_path)
    with open(model_path, "rb") as f:
        h.update(f.read(_EDGE))
        f.seek(max(size - _EDGE, 0))
        h.update(f.read(_EDGE))
    cc = cache_config
    for part in (str(size), chat_template or "", str(cc.block_size), format_identity(cc.kv_dtype), cc.state_dtype,
                 device_type,
                 FORMAT_VERSION) + ((f"tp{world}.{rank}",) if world > 1 else ()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()


def model_fingerprint(model, cache_config: CacheConfig, rank: int = 0, world: int = 1) -> str:
    """`fingerprint` of a loaded `Model`'s file, chat template and device."""
    template = getattr(model.chat_template, "source", "")
    return fingerprint(model.path, template, cache_config, model.device.type, rank, world)


def _make_private_dir(path: Path) -> None:
    """Create `path` and any missing parent 0700 (mkdir -p would leave the parents world-readable)."""
    for d in [*reversed(path.parents), path]:
        if not d.exists():
            d.mkdir(mode=0o700, exist_ok=True)
    path.chmod(0o700)


def file_name(tokens: tuple[int, ...]) -> str:
    """A checkpoint's file name (the same in every tensor-parallel rank's directory)."""
    return hashlib.sha256(repr(tokens).encode()).hexdigest()[:32] + ".safetensors"


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in _NAMES + tuple(n for n in _SIDES if n in tensors):
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class PrefixStore:
    """Checkpoint files in `directory` (0700, files 0600), least recently used evicted beyond `budget_bytes`.

    The index (token ids -> file) is read once at start; tensors are read only on a hit.
    """

    def __init__(self, directory: str | os.PathLike, budget_bytes: int, fingerprint: str, max_pending: int = 8,
                 max_pending_bytes: int = 1 << 30):
        self.dir = Path(directory)
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self._index: dict[tuple[int, ...], Path] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.max_pending_bytes = max_pending_bytes  # snapshots waiting to be written hold device memory
        self._pending_bytes = 0
        self._write_failed = False
        self._seq = 0
        self._used: dict[str, int] = {}  # file name -> order of its last use in this process (mtimes are coarse)
        try:
            _make_private_dir(self.dir)
        except OSError as err:
            log.warning("prefix cache dir %s: %s (checkpoints are not written)", self.dir, err)
        self._remove_orphans()
        self._read_index()
        self._thread = threading.Thread(target=self._writer, name="prefix-store", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # ---- reading --------------------------------------------------------------------------------
    def _read_index(self) -> None:
        paths = sorted(self.dir.glob("*.safetensors")) if self.dir.is_dir() else []
        for path in paths:
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                    if meta.get("format") != FORMAT_VERSION or meta.get("fingerprint") != self.fingerprint:
                        log.info("prefix cache: %s is from another model or version; ignored", path.name)
                        continue
                    tokens = tuple(f.get_tensor("tokens").tolist())
            except Exception as err:  # truncated, not safetensors, unreadable
                log.warning("prefix cache: %s does not load (%s); ignored", path.name, err)
                continue
            self._index[tokens] = path
        if self._index:
            log.info("prefix cache: %d checkpoints on disk in %s", len(self._index), self.dir)

    def _remove_orphans(self) -> None:
        """Delete temp files left by writers that died mid-write (kill -9, power loss): never renamed, never
        read, they only hold disk. A live process's temp file (another server on this directory) is kept."""
        for path in self.dir.glob(".*.tmp") if self.dir.is_dir() else []:
            try:
                pid = int(path.name.rsplit(".", 2)[-2])
                os.kill(pid, 0)
            except (ValueError, ProcessLookupError):
                path.unlink(missing_ok=True)
                log.info("prefix cache: removed %s, left by an interrupted write", path.name)
            except OSError:  # a live process of another user
                pass

    def lookup(self, prompt: list[int], longer_than: int = 0) -> Optional[tuple[int, ...]]:
        """The longest stored prefix the prompt strictly extends, if longer than `longer_than` tokens."""
        best: Optional[tuple[int, ...]] = None
        with self._lock:
            keys = list(self._index)
        for tokens in keys:
            n = len(tokens)
            if longer_than < n < len(prompt) and (best is None or n > len(best)) and tuple(prompt[:n]) == tokens:
                best = tokens
        return best

    def has(self, tokens: tuple[int, ...]) -> bool:
        with self._lock:
            return tokens in self._index

    def load(self, tokens: tuple[int, ...]) -> Optional[CacheSnapshot]:
        """The checkpoint of exactly `tokens`, or None (logged, and forgotten) when its file is bad."""
        try:
            return self.read(tokens)
        except LookupError:
            return None
        except ValueError as err:
            log.warning("prefix cache: %s; a miss", err)
            return None

    def read(self, tokens: tuple[int, ...]) -> CacheSnapshot:
        """The checkpoint of exactly `tokens`: LookupError when none is stored, ValueError (naming the file, which
        is then forgotten) when it does not load or verify."""
        with self._lock:
            path = self._index.get(tokens)
        if path is None:
            raise LookupError(f"no checkpoint of {len(tokens)} tokens")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                t = {name: f.get_tensor(name) for name in _NAMES + tuple(n for n in _SIDES if n in f.keys())}
            if meta.get("fingerprint") != self.fingerprint or tuple(t["tokens"].tolist()) != tokens:
                raise ValueError("header does not match")
            if meta.get("sha256") != _digest(t) or int(meta.get("num_tokens", -1)) != len(tokens):
                raise ValueError("checksum mismatch")
        except Exception as err:
            self.forget(tokens)
            raise ValueError(f"{path.name} does not load ({err})") from err
        self._touch(path)
        return CacheSnapshot(len(tokens), t["k"], t["v"], t["conv"], t["recurrent"], t.get("k_side"), t.get("v_side"))

    def forget(self, tokens: tuple[int, ...]) -> None:
        """Drop a checkpoint from the index (its file stays until evicted)."""
        with self._lock:
            self._index.pop(tokens, None)

    # ---- writing --------------------------------------------------------------------------------
    def save(self, cache: HybridCache, slot: int, tokens: tuple[int, ...], states: Optional[LinearStates] = None
             ) -> bool:
        """Queue the checkpoint of `tokens` that `slot` holds (see `HybridCache.snapshot`); whether it was queued.
        The snapshot is a copy, so it is taken only when the write would be queued."""
        nbytes = len(tokens) * cache.bytes_per_token + cache.fixed_bytes_per_slot
        if not self.wants(tokens, nbytes):
            return False
        return self.put(tokens, cache.snapshot(slot, len(tokens), states))

    def put(self, tokens: tuple[int, ...], snapshot: CacheSnapshot) -> bool:
        """Queue a checkpoint for writing; dropped (False) when already stored or when the queue is full."""
        if not self.wants(tokens, snapshot.nbytes):
            log.debug("prefix cache: write queue full; checkpoint of %d tokens not written", len(tokens))
            return False
        with self._lock:
            self._pending_bytes += snapshot.nbytes
        try:
            self._queue.put_nowait((tokens, snapshot))
        except queue.Full:
            with self._lock:
                self._pending_bytes -= snapshot.nbytes
            return False
        return True

    def wants(self, tokens: tuple[int, ...], nbytes: int) -> bool:
        """Whether a checkpoint of `tokens` (`nbytes`) would be queued; callers skip the snapshot otherwise.
        One snapshot is always accepted into an empty queue, however large."""
        with self._lock:
            if tokens in self._index or self._queue.full():
                return False
            return self._pending_bytes == 0 or self._pending_bytes + nbytes <= self.max_pending_bytes

    def flush(self) -> None:
        """Wait until every queued checkpoint is written (or dropped)."""
        self._queue.join()

    def _writer(self) -> None:
        while True:
            tokens, snap = self._queue.get()
            try:
                self._write(tokens, snap)
            except Exception as err:  # full disk, read-only directory, vanished directory
                if not self._write_failed:
                    log.warning("prefix cache: cannot write to %s (%s); requests go on without it", self.dir, err)
                self._write_failed = True
            finally:
                with self._lock:
                    self._pending_bytes -= snap.nbytes
                self._queue.task_done()

    def _write(self, tokens: tuple[int, ...], snap: CacheSnapshot) -> None:
        t = {"tokens": torch.tensor(tokens, dtype=torch.int64), "k": snap.k.cpu().contiguous(),
             "v": snap.v.cpu().contiguous(), "conv": snap.conv.cpu().contiguous(),
             "recurrent": snap.recurrent.cpu().contiguous()}
        if snap.k_side is not None:
            t.update(k_side=snap.k_side.cpu().contiguous(), v_side=snap.v_side.cpu().contiguous())
        meta = {"format": FORMAT_VERSION, "fingerprint": self.fingerprint, "num_tokens": str(len(tokens)),
                "sha256": _digest(t)}
        data = save(t, metadata=meta)
        name = file_name(tokens)
        tmp = self.dir / f".{name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._index[tokens] = self.dir / name
        self._touch(self.dir / name)
        self._evict()

    def _touch(self, path: Path) -> None:
        """Mark a file most recently used: by mtime across restarts, by use order within this process."""
        with self._lock:
            self._seq += 1
            self._used[path.name] = self._seq
        try:
            os.utime(path)
        except OSError:
            pass

    def _evict(self) -> None:
        """Delete least recently used files until the directory's checkpoints fit the budget."""
        files = []
        for path in self.dir.glob("*.safetensors"):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((self._used.get(path.name, 0), st.st_mtime, st.st_size, path))
        files.sort()
        total = sum(f[2] for f in files)
        for _, _, size, path in files:
            if total <= self.budget_bytes:
                break
            self._remove(path)
            total -= size
            with self._lock:
                for tokens in [k for k, p in self._index.items() if p == path]:
                    del self._index[tokens]

    def _remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)
