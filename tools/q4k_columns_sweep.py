"""The Q4_K column kernel (kernels/quant/q4k_columns.py) against cuBLAS on the bf16 dequantized copy, per 9B Q4_K
projection shape and row count (CUDA only): the kernel's configurations swept (column blocks of 32, 64 and 128,
parts of K), the one `config()` picks, and cuBLAS; the last lines sum a 9B token's Q4_K projections
(hf2q.bench.quant.LAYER_SET).

    python tools/q4k_columns_sweep.py [--rows 8 16 32 64]

Times are CUDA-graph replays over copies that overflow L2 (kernels/tuning/timing.py), µs a call.
"""
from __future__ import annotations

import argparse
import math

import torch

from hf2q.bench.quant import LAYER_SET
from hf2q.kernels.quant import q4k_columns as qc
from hf2q.kernels.tuning.timing import graph_time_us
from hf2q.quant import random_blocks


def _copies(make, nbytes: int) -> list:
    """make() and enough further results of it to span three L2 caches."""
    n = max(1, math.ceil(3 * torch.cuda.get_device_properties(0).L2_cache_size / nbytes))
    return [make() for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = p.parse_args()
    totals: dict[tuple[int, str], float] = {}
    for name, n, k, qtype, times in LAYER_SET:
        if qtype != "Q4_K":
            continue
        raw = random_blocks(qtype, n, k, std=0.02, seed=n + k).to("cuda")
        cols = qc.from_blocks(raw, n)
        layouts = _copies(lambda: qc.Q4KColumns(*(t.clone() for t in (cols.codes, cols.scales, cols.d, cols.dmin))),
                          cols.nbytes)
        dense = qc.dequantize(cols).to(torch.bfloat16)
        denses = _copies(dense.clone, dense.nbytes)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = torch.nn.functional.linear(x, dense).float()
            t_dense = graph_time_us(lambda w: torch.nn.functional.linear(x, w), denses)
            err = float((qc.columns_mm(x, cols).float() - ref).norm() / ref.norm())
            t_default = graph_time_us(lambda c: qc.columns_mm(x, c), layouts)
            swept = sorted((graph_time_us(lambda c: qc.columns_mm(x, c, (bn, 4, 3, s)), layouts), bn, s)
                           for bn in (32, 64, 128) for s in args.splits if s <= k // 256)
            totals[(m, "cuBLAS")] = totals.get((m, "cuBLAS"), 0.0) + t_dense * times
            totals[(m, "columns")] = totals.get((m, "columns"), 0.0) + t_default * times
            print(f"{name} {n}x{k}, {m} rows: cuBLAS {t_dense:.1f} us, columns {t_default:.1f} us at "
                  f"{qc.config(n, k)} ({cols.nbytes / t_default / 1e6:.2f} TB/s, error {err:.1e} relative to cuBLAS); "
                  "best " + ", ".join(f"{t:.1f} (BN {bn}, {s} parts)" for t, bn, s in swept[:3]), flush=True)
    for (m, path), us in sorted(totals.items()):
        print(f"{m} rows, {path}: a 9B token's Q4_K projections {us / 1000:.3f} ms")


if __name__ == "__main__":
    main()
