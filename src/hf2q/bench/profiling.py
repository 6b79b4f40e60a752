"""Where a repeated step's time goes, by torch's profiler: the bench's decode and prefill profiles and the
verify curve's rounds read the same figures."""
from __future__ import annotations

import time

import torch


def profile_steps(step, reps: int = 4, top: int = 20) -> dict:
    """Per call of step: wall ms, the GPU's busy ms (kernels and copies), and the top ops by GPU time and by
    host time as [name, ms a call, launches a call]."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(reps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    gpu = [(e.key[:70], e.self_device_time_total / reps / 1e3, e.count // reps) for e in events
           if e.device_type == DeviceType.CUDA]  # kernels and copies themselves, not the host ops launching them
    host = [(e.key[:70], e.self_cpu_time_total / reps / 1e3, e.count // reps) for e in events
            if e.device_type == DeviceType.CPU]
    gpu.sort(key=lambda r: -r[1])
    host.sort(key=lambda r: -r[1])
    return {"wall_ms": round(wall / reps * 1e3, 3), "gpu_busy_ms": round(sum(r[1] for r in gpu), 3),
            "gpu_top": [[n, round(ms, 4), c] for n, ms, c in gpu[:top]],
            "host_top": [[n, round(ms, 4), c] for n, ms, c in host[:top]]}
