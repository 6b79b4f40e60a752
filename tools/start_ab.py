"""Where a start's first seconds go: a GGUF's load and fla's import, each alone and side by side.

    python tools/start_ab.py --model M.gguf [--device cuda] [--repeat 2]

`hf2q serve` imports fla's delta-rule kernels on a thread beside its start and load (hf2q.kernels.gdn.chunked_fla).
Both are Python work under one interpreter lock, so side by side they can take as long as one after the other, or
longer where each waits for the lock. Each variant runs in a fresh process (Python's import happens once a process)
and prints its seconds from torch's import on: setup_s (hf2q's imports and the device's first use), load_s, fla_s
and total_s:

    alone:      the load alone (as `hf2q serve` loads: quantized weights kept as blocks)
    fla:        fla's import alone
    then:       fla's import, then the load
    beside:     the load with fla's import on a thread, as `hf2q serve` did before 4c2a035 (and the import's own time)
    beside-1ms: the same with the interpreter's switch interval at 1 ms instead of 5 (a thread waiting for the
                lock gets it sooner)
    early:      fla's import on a thread from right after hf2q's imports, before the device's first use, as `hf2q serve`
                starts it since 4c2a035
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

VARIANTS = ("alone", "fla", "then", "beside", "beside-1ms", "early")

RUN = r"""
import json, sys, threading, time
import torch
variant, model, device = sys.argv[1:4]
times = {}

def import_fla():
    t0 = time.perf_counter()
    import fla.ops.gated_delta_rule  # noqa: F401
    times["fla_s"] = time.perf_counter() - t0

t_early = time.perf_counter()
import hf2q
from hf2q.checkpoint.loader import staged_copier  # noqa: F401  (the loader's modules imported beforehand)
if variant == "early":
    early = threading.Thread(target=import_fla)
    early.start()
if device == "cuda":
    torch.zeros(1, device="cuda")

def load():
    t0 = time.perf_counter()
    hf2q.load(model, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
              keep_quantized=device == "cuda")
    if device == "cuda":
        torch.cuda.synchronize()
    times["load_s"] = time.perf_counter() - t0

times["setup_s"] = time.perf_counter() - t_early  # hf2q's imports and the device's first use
if variant == "early":
    load()
    early.join()
elif variant == "fla":
    import_fla()
elif variant == "alone":
    load()
elif variant == "then":
    import_fla()
    load()
else:
    if variant == "beside-1ms":
        sys.setswitchinterval(0.001)
    thread = threading.Thread(target=import_fla)
    thread.start()
    load()
    thread.join()
times["total_s"] = time.perf_counter() - t_early
print(json.dumps({"variant": variant, **{k: round(v, 2) for k, v in times.items()}}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = p.parse_args()
    for r in range(args.repeat):
        for variant in args.variants:
            done = subprocess.run([sys.executable, "-c", RUN, variant, args.model, args.device],
                                  capture_output=True, text=True)
            line = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None
            print(line or json.dumps({"variant": variant, "error": done.stderr.strip()[-500:]}), flush=True)


if __name__ == "__main__":
    main()
