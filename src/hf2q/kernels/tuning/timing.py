"""Kernel timing as a served decode step sees it: from CUDA-graph replays (no host launch cost) over
copies of the weight that together overflow the L2 cache (each weight read from memory, as when the
rest of the model's weights pass between two uses of it)."""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch


@dataclass
class Spent:
    """What timing configurations has cost this process so far: shapes timed, seconds compiling their
    candidates, seconds timing them. A start's log shows it beside each warm-up phase, so a slow first
    start says whether compiling or timing took the time."""
    shapes: int = 0
    compile_s: float = 0.0
    timing_s: float = 0.0

    def since(self, before: "Spent") -> str:
        return (f"{self.shapes - before.shapes} mat-vec shapes timed: "
                f"compiling {self.compile_s - before.compile_s:.1f} s, timing {self.timing_s - before.timing_s:.1f} s")

    def snapshot(self) -> "Spent":
        return replace(self)


SPENT = Spent()


@contextmanager
def clock(field: str):
    """Adds the seconds of its block to SPENT's `field`."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        setattr(SPENT, field, getattr(SPENT, field) + time.monotonic() - t0)


def cold_copies(w: torch.Tensor, limit_bytes: float = 512e6) -> list[torch.Tensor]:
    """w and enough clones of it to span three L2 caches (at most limit_bytes in all, w included)."""
    l2 = torch.cuda.get_device_properties(w.device).L2_cache_size
    n = max(1, min(math.ceil(3 * l2 / w.nbytes), int(limit_bytes // w.nbytes)))
    return [w] + [w.clone() for _ in range(n - 1)]


def graph_time_us(fn, weights: list, reps: int = 10) -> float:
    """µs per call of fn(w), from replays of one CUDA graph that calls it on every entry of `weights`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in weights:
            fn(w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(weights))


def time_configs(configs, error_of, time_of, limit: float = 1e-2) -> list[tuple[float, object]]:
    """(µs, config), fastest first, of every configuration whose output is within `limit` (relative) of the
    reference: error_of(config) checks it, time_of(config) times it. One that is off, or does not compile,
    is reported and left out."""
    times = []
    for config in configs:
        try:
            err = error_of(config)
            if err > limit:
                print(f"  {config}: relative error {err:.2e}, skipped")
                continue
            times.append((time_of(config), config))
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile is left out
            print(f"  {config}: {type(e).__name__} {str(e)[:80]}")
    return sorted(times)


def describe(times: list[tuple[float, object]], reference, name: str, top: int = 5) -> str:
    """A sweep's line: the reference configuration's time (under `name`) beside the `top` fastest."""
    ref = next(t for t, c in times if c == reference)
    return f"{name} {reference} {ref:.2f} µs; fastest " + ", ".join(f"{c} {t:.2f}" for t, c in times[:top])
