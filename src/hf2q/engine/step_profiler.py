"""torch's profiler over the steps a serving engine takes between a start and a stop request (`hf2q serve
--profile-dir DIR`, then POST /start_profile and /stop_profile, as vLLM and SGLang serve them): where a served
step's time goes under the load that is really there, kernels and host alike, rather than a re-enactment of it
in-process.

Start and stop run on the engine's own thread (`AsyncEngine.call`), so the profiler records that thread's work;
each step is marked `hf2q.step` in the trace. A stop writes a Chrome trace (gzip; chrome://tracing or Perfetto
read it) and a table of the ops with the most time, named hf2q-<date>-<time>-<pid>-<n>. (torch is imported on use:
`hf2q serve --help` imports this module and must not wait for torch.)"""
from __future__ import annotations

import os
import time
from pathlib import Path


class ProfileError(ValueError):
    """A start while a profile runs, or a stop while none does."""


class StepProfiler:
    def __init__(self, directory: str | Path, device):
        self.directory = Path(directory)
        self.device = device
        self._profile = None
        self._steps = 0
        self._started = 0.0
        self._written = 0

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self) -> dict:
        """Begin recording (on the engine's thread)."""
        if self._profile is not None:
            raise ProfileError("a profile is already running: POST /stop_profile first")
        from torch.profiler import ProfilerActivity, profile

        self.directory.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._profile = profile(activities=activities)
        self._profile.start()
        self._steps, self._started = 0, time.monotonic()
        return {"status": "profiling"}

    def step(self):
        """A context marking one engine step in the trace (and counting it)."""
        from torch.profiler import record_function

        self._steps += 1
        return record_function("hf2q.step")

    def stop(self) -> dict:
        """End recording (on the engine's thread) and write the trace and the table; their paths and counts."""
        if self._profile is None:
            raise ProfileError("no profile is running: POST /start_profile first")
        import torch

        prof, self._profile = self._profile, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof.stop()
        seconds = time.monotonic() - self._started
        self._written += 1
        name = f"hf2q-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._written}"
        trace = self.directory / f"{name}.trace.json.gz"
        prof.export_chrome_trace(str(trace))
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.directory / f"{name}.txt"
        table.write_text(f"{self._steps} engine steps in {seconds:.3f} s\n\n"
                         + prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70) + "\n")
        return {"status": "stopped", "steps": self._steps, "seconds": round(seconds, 3), "trace": str(trace),
                "table": str(table)}
