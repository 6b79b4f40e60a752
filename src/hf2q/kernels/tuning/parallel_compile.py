"""Autotuned Triton kernels compile their candidate configurations on all the host's cores at once.

Triton's autotuner compiles each candidate when it first times it, one after another. The kernels of fla's
chunked delta-rule forward carry about a hundred candidates (a third of a second each to compile on a CPU core), and
the first prefill on a fresh machine took a minute and a half (9B Q4_K_M on an H100: 85.8 s; 16.4 s once Triton's
cache held its kernels). Inside `compile_candidates_in_parallel()`, an autotuner about to time the candidates of a
new key first hands all their compilations to a thread pool through Triton's own asynchronous compile mode
(`AsyncCompileMode`: a JIT function run with `warmup=True` compiles there and launches nothing), then times them as
before: the same candidates timed the same way, the same choice, only their compilation overlapped. A compilation
that fails is left to the timing, which reports it as Triton always has.

The autotuner is reached through two of its methods (`prune_configs`, which lists a key's candidates, and
`_bench`, which times one): a Triton without them, or without the asynchronous mode, compiles one by one as
before.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

_LOCK = threading.Lock()


def _hooks():
    """Triton's Autotuner and AsyncCompileMode, or None where this Triton lacks what the overlap uses."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return None
    if not all(callable(getattr(Autotuner, name, None)) for name in ("prune_configs", "_bench")):
        return None
    return Autotuner, AsyncCompileMode


def compile_side_by_side(warm, configs, pool, kernel) -> bool:
    """warm(config) for every config, where warm compiles `kernel` (a JIT function, or a wrapper of one) without
    launching it (a run with `warmup=True`), with the compilations submitted to `pool` at once; returns when all
    have ended. Each compiled kernel lands in the function's own cache under the key a launch with the same
    arguments looks up. A compilation that failed leaves nothing there, so that launch compiles it again (and
    reports what fails): some Triton versions keep the failed placeholder, and on Python before 3.11.8 (3.12.2)
    `ast.parse`, which Triton's compiler calls, can fail spuriously when two threads parse at once. False (nothing
    done) where this Triton has no asynchronous compile mode."""
    hooks = _hooks()
    if hooks is None:
        return False
    try:
        with hooks[1](pool, ignore_errors=True):
            for config in configs:
                warm(config)
    finally:
        _drop_failed(kernel)
    return True


def _drop_failed(kernel) -> None:
    """Remove from the JIT function's caches the placeholders of compilations that failed."""
    while not hasattr(kernel, "device_caches") and hasattr(kernel, "fn"):
        kernel = kernel.fn
    for caches in getattr(kernel, "device_caches", {}).values():
        cache = caches[0]
        for key, compiled in list(cache.items()):
            fields = getattr(compiled, "__dict__", {})  # a placeholder's own fields: never ask it for its result
            future = fields.get("future")
            if future is not None and fields.get("kernel") is None and future.done() and future.exception() is not None:
                del cache[key]


def compile_all(tuner, configs, args: tuple, meta: dict, pool) -> None:
    """Compile `tuner`'s kernel for each of `configs` with a call's arguments and keywords (a launch's carry its
    grid and `warmup=False`), side by side: the call each timing makes, with `warmup=True`."""
    def warm(config):
        tuner.fn.run(*args, **{"grid": (1,), **meta, **config.all_kwargs(), "warmup": True})

    compile_side_by_side(warm, configs, pool, tuner.fn)


@dataclass
class Compiled:
    """What an opening of compile_candidates_in_parallel did: autotuner keys whose candidates it compiled, how many
    candidates, the seconds the callers waited for them. A warm-up logs it."""
    keys: int = 0
    candidates: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        return (f"{self.candidates} autotuner candidates of {self.keys} kernel keys compiled side by side in "
                f"{self.seconds:.1f} s")


@contextlib.contextmanager
def compile_candidates_in_parallel(workers: int | None = None):
    """While open, every Triton autotuner compiles a new key's candidates side by side before timing them (see
    the module's docstring); yields a Compiled that counts them. Meant for a warm-up, where the first calls of
    every kernel happen; not reentrant across threads (a second opening while one is open does nothing more)."""
    done = Compiled()
    hooks = _hooks()
    if hooks is None or not _LOCK.acquire(blocking=False):
        yield done
        return
    tuner_class = hooks[0]
    prune_configs, bench = tuner_class.prune_configs, tuner_class._bench
    pool = ThreadPoolExecutor(workers or os.cpu_count() or 1, thread_name_prefix="triton-compile")
    failed = []

    def listing(self, kwargs):
        configs = prune_configs(self, kwargs)
        self._hf2q_uncompiled = configs  # the candidates the timing that may follow will go through
        return configs

    def timing(self, *args, config, **meta):
        pending = self.__dict__.pop("_hf2q_uncompiled", None)
        if pending is not None and len(pending) > 1 and not failed:
            t0 = time.monotonic()
            try:
                compile_all(self, pending, args, meta, pool)
                done.keys, done.candidates = done.keys + 1, done.candidates + len(pending)
            except Exception as err:  # noqa: BLE001 - only an overlap: the timing compiles what is missing
                failed.append(err)
                warnings.warn(f"compiling autotuner candidates side by side failed ({type(err).__name__}: {err}); "
                              "they compile one by one as they are timed", stacklevel=2)
            done.seconds += time.monotonic() - t0
        return bench(self, *args, config=config, **meta)

    tuner_class.prune_configs, tuner_class._bench = listing, timing
    try:
        yield done
    finally:
        tuner_class.prune_configs, tuner_class._bench = prune_configs, bench
        pool.shutdown(wait=True)
        _LOCK.release()
