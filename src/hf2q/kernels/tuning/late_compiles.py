"""A watch on Triton building kernels once the warm-up is over.

Everything a request would compile is meant to be compiled before `/health` says 200; a kernel variant
that Triton builds (or loads from its disk cache) while serving is a wait some request paid, mid-stream.
The watch names each such variant once in the log, with the time it took and what it was specialised on
(an integer argument that is 1 or a multiple of 16 makes a new variant), and counts them for /metrics, so a
first-request stall on the GPU says which kernel caused it instead of needing a profiler to find it.
It sits in Triton's JIT hooks (`triton.knobs.runtime`), chained after any hook already there. A mat-vec
shape whose configurations are timed while serving (hf2q.kernels.quant.dp4a_triton: graph replays of every
candidate on the GPU, no build at all when Triton's cache has them) is logged and counted the same way.
"""
from __future__ import annotations

import json
import logging
import threading
import time

log = logging.getLogger("hf2q.compiles")


class LateCompiles:
    """Kernel variants built after the warm-up: `count`, `seconds` spent building them, the latest `names`;
    `timings` and `timing_seconds` for mat-vec shapes timed after it."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.count = 0
        self.seconds = 0.0
        self.names: list[str] = []
        self._started: dict[tuple, float] = {}
        self._lock = threading.Lock()  # kernels compile on the engine thread and on compile-pool threads
        self._chained: tuple = (None, None)
        self.watching = False
        self.timings = 0
        self.timing_seconds = 0.0

    def install(self) -> bool:
        """Start watching; False where this Triton has no JIT hooks (nothing is watched)."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if not (hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook")):
            return False
        if runtime.jit_cache_hook == self.before:  # a second server in this process: watching already
            return True
        self._chained = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self.before, self.after
        self.watching = True
        return True

    def uninstall(self) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._chained
        self.watching = False

    def timed_late(self, what: str, seconds: float) -> None:
        """A mat-vec shape's configurations were timed after the warm-up (on the GPU, while a request waited):
        log it, count it. A no-op while not watching (the warm-up times shapes on purpose)."""
        if not self.watching:
            return
        with self._lock:
            self.timings += 1
            self.timing_seconds += seconds
        log.warning("mat-vec shape timed after warm-up in %.0f ms (a request waited for it): %s", seconds * 1000, what)

    def before(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        """Triton is about to build a variant: note when (never skips the build)."""
        with self._lock:
            self._started[(fn.name, str(key))] = self.clock()
        chained = self._chained[0]
        return chained(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                       already_compiled=already_compiled) if chained else None

    def after(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        """Triton has built a variant after the warm-up: log it once, count it."""
        with self._lock:
            started = self._started.pop((fn.name, str(key)), None)
            spent = self.clock() - started if started is not None else 0.0
            self.count += 1
            self.seconds += spent
            self.names = (self.names + [fn.name])[-16:]
        log.warning("kernel built after warm-up in %.0f ms (a request waited for it): %s.%s %s", spent * 1000,
                    fn.module, fn.name, _specialisation(repr, compile))
        chained = self._chained[1]
        return chained(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                       already_compiled=already_compiled) if chained else None


WATCH = LateCompiles()  # Triton's hooks are the process's: one watch


def _specialisation(text: str, compile: dict, limit: int = 600) -> str:
    """What the variant was specialised on, cut to a log line's length: its options, every argument Triton fixed
    (a constexpr, or an integer of 1, as name=value) and every one it took as a multiple of 16 (name%16), from the
    build's specialisation data; else Triton's own description (Triton 3.6's zips the parameters with its cache
    key, a string, and so names the first parameter only)."""
    try:
        data = json.loads(compile["specialization_data"])
        fixed = {k[0]: v for k, v in zip(data["constant_keys"], data["constant_vals"]) if len(k) == 1}
        hinted = {k[0] for k, v in zip(data["attrs_keys"], data["attrs_vals"])
                  if len(k) == 1 and any(attr[0] == "tt.divisibility" for attr in v)}
        args = []
        for i, name in enumerate(data["signature"]):
            if i in fixed:
                value = fixed[i]
                args.append(f"{name}={value['constexpr'] if isinstance(value, dict) else value}")
            elif i in hinted:
                args.append(f"{name}%16")
        options = data.get("options", {})
        text = (f"[num_warps={options.get('num_warps')}, num_stages={options.get('num_stages')}]"
                f"({', '.join(args)})")
    except (KeyError, TypeError, ValueError, IndexError):
        pass
    return text if len(text) <= limit else text[:limit] + " ..."
