"""Batched decode on Q4_K_M weights: the tensor-core kernel (mm_triton) in several configurations
against the int8 tensor-core kernel (mmq_triton, HF2Q_QUANT_MM=mmq; Q8_0 and K-quants), the int8
mat-vec and dequantize + cuBLAS, per 9B projection and row count (CUDA only).

    python tools/quant_mm_sweep.py [--rows 8 16 32 64]

mmq is timed on activations already in int8 rows (as a producer that writes them would leave them) and
with their quantization (quantize_rows) in the timed call; its error is relative (Frobenius) to
dequantize + cuBLAS on the same bf16 activations, beside the tile kernel's.
Times are CUDA-graph replays over weight copies that overflow L2 (kernels/tuning/timing.py), summed over a 9B
token's projections (hf2q.bench.quant.LAYER_SET); the last lines give the step time of each path.
"""
from __future__ import annotations

import argparse

import torch

from hf2q.kernels.quant import int8_rows
from hf2q.kernels.quant import mm_triton as mm
from hf2q.kernels.quant import mmq_triton as mmq
from hf2q.bench.quant import LAYER_SET
from hf2q.kernels.quant.dp4a_triton import gemv
from hf2q.kernels.quant.ops import dequantize, scratch
from hf2q.kernels.tuning.timing import cold_copies, graph_time_us
from hf2q.quant import keep_blocks, random_blocks


def _us(fn, weights) -> float:
    fn(weights[0])
    torch.cuda.synchronize()
    return graph_time_us(fn, weights)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--matvec", action="store_true", help="also time the int8 mat-vec (tunes per row count)")
    p.add_argument("--configs", nargs="+", default=["64,4", "64,8", "128,8"], metavar="BLOCK_N,WARPS",
                   help="tile configurations to time (each at the default split of K and twice it)")
    p.add_argument("--no-split-variants", action="store_true", help="time each configuration at the default split only")
    args = p.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    totals: dict[tuple, float] = {}
    for name, n, k, qtype, times in LAYER_SET:
        raw = keep_blocks(random_blocks(qtype, n, k, std=0.02, seed=n + k), qtype, "cuda")
        copies = cold_copies(raw)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {}
            _, _, auto_split = mm.config(n, k)
            for bn, warps in configs:
                for split in sorted({auto_split} if args.no_split_variants else {auto_split, auto_split * 2}):
                    cfg = (bn, warps, split)
                    row[cfg] = _us(lambda w, c=cfg: mm.quant_mm(x, w, qtype, n, c), copies)
            row["default"] = _us(lambda w: mm.quant_mm(x, w, qtype, n), copies)
            row["dequant+cublas"] = _us(lambda w: torch.nn.functional.linear(
                x, dequantize(w, qtype, (n, k), x.dtype, out=scratch("sweep", n * k, x.dtype, x.device))), copies)
            if args.matvec and m <= 16:
                row["int8 mat-vec"] = _us(lambda w: gemv(x, w, qtype, n), copies)
            mmq_note = ""
            if qtype in mmq.TYPES:
                rows8 = int8_rows.quantize_rows(x, blocked=True)
                row["mmq"] = _us(lambda w: mmq.quant_mmq(rows8, w, qtype, n, out_dtype=x.dtype), copies)
                # a new view of x each call: quantize_rows finds no earlier result, the graph holds its launch
                row["mmq+quantize"] = _us(lambda w: mmq.quant_mmq(x.view_as(x), w, qtype, n), copies)
                ref = torch.nn.functional.linear(x, dequantize(raw, qtype, (n, k), x.dtype))
                mmq_note = (f", mmq {row['mmq']:8.1f} (+quantize {row['mmq+quantize']:8.1f}), error mmq "
                            f"{_rel(mmq.quant_mmq(rows8, raw, qtype, n), ref):.1e} tile "
                            f"{_rel(mm.quant_mm(x, raw, qtype, n), ref):.1e}")
            for path in ("mmq", "mmq+quantize"):  # the step with HF2Q_QUANT_MM=mmq: other types on the tile kernel
                row[path + " path"] = row.get(path, row["default"])
            best = min((v, c) for c, v in row.items() if isinstance(c, tuple))
            print(f"{name:12} {qtype} {n}x{k} m={m:3}: default {row['default']:8.1f} us, best {best[0]:8.1f} "
                  f"{best[1]}, dequant+cublas {row['dequant+cublas']:8.1f}" + mmq_note
                  + (f", int8 mat-vec {row['int8 mat-vec']:8.1f}" if "int8 mat-vec" in row else ""), flush=True)
            for c, v in row.items():
                totals[(m, c)] = totals.get((m, c), 0.0) + v * times
        del raw, copies
    for m in args.rows:
        per = {c: v for (mm_, c), v in totals.items() if mm_ == m}
        best = min((v, c) for c, v in per.items() if isinstance(c, tuple))
        print(f"9B step, m={m}: default {per['default'] / 1e3:.3f} ms; best single config {best[0] / 1e3:.3f} ms "
              f"{best[1]}; dequant+cublas {per['dequant+cublas'] / 1e3:.3f} ms; HF2Q_QUANT_MM=mmq "
              f"{per['mmq path'] / 1e3:.3f} ms (with quantization {per['mmq+quantize path'] / 1e3:.3f} ms)"
              + (f"; int8 mat-vec {per['int8 mat-vec'] / 1e3:.3f} ms" if "int8 mat-vec" in per else ""), flush=True)


if __name__ == "__main__":
    main()
