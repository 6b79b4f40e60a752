"""Timing of the quantized kernels on a 9B-shape Q4_K_M projection set (CUDA only).

Decode: each projection's mat-vec at 1 (and 4, 16) rows, against the weight-bytes ceiling (bytes /
bandwidth). Prefill: dequantize-to-scratch + bf16 matmul at 4096 rows, against the plain bf16 matmul.
Kernel times come from CUDA-graph replays over copies of each weight that overflow L2, so host launch
cost is not counted and each weight comes from memory (a served decode step is a graph replay, and
the model's other weights pass between two uses of one). The mat-vec configuration is the one its first
use picked on this device; each projection's line shows it. Run: python -m hf2q.bench.quant
"""
from __future__ import annotations

import argparse
from math import nan

import torch

from hf2q.kernels.quant import dp4a_triton as quant_dp4a_triton
from hf2q.kernels.quant.ops import quant_linear
from hf2q.kernels.tuning.timing import cold_copies, graph_time_us
from hf2q.quant import keep_blocks, random_blocks

H, I = 4096, 12288
# (name, out, in, type, times per 9B model): 24 DeltaNet + 8 attention layers, 32 FFNs, the head.
# Types as llama.cpp's Q4_K_M mix gives them (see bench_shapes.quant_plan), packed as the model packs them.
LAYER_SET = [("gdn.qkv", 8192, H, "Q5_K", 24), ("gdn.z+a+b", 4096 + 64, H, "Q4_K", 24),
             ("gdn.out", H, 4096, "Q4_K", 24), ("attn.q+k", 8192 + 1024, H, "Q4_K", 8),
             ("attn.v", 1024, H, "Q6_K", 8), ("attn.o", H, 4096, "Q4_K", 8), ("ffn.gate+up", 2 * I, H, "Q4_K", 32),
             ("ffn.down", H, I, "Q6_K", 16), ("ffn.down4", H, I, "Q4_K", 16), ("lm_head", 248320, H, "Q6_K", 1)]


def _us(fn, weights) -> float:
    fn(weights[0])  # eager first: compiles, and picks the mat-vec configuration outside graph capture
    torch.cuda.synchronize()
    return graph_time_us(fn, weights)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--only", nargs="+", default=None, choices=[row[0] for row in LAYER_SET], metavar="PROJ",
                   help="time only these projections: " + ", ".join(row[0] for row in LAYER_SET))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16],
                   help="activation row counts to time (each picks its mat-vec configuration by timing); the "
                        "table shows 1 and the next two")
    p.add_argument("--batch-1-only", action="store_true", help="the same as --rows 1")
    args = p.parse_args(argv)
    if min(args.rows) < 1:
        p.error(f"--rows takes counts of at least 1, not {min(args.rows)}")
    row_counts = (1,) if args.batch_1_only else tuple(dict.fromkeys([1, *args.rows]))
    shown = (list(row_counts[1:]) + [None, None])[:2]  # the table's two columns past one row (None: not timed)
    from hf2q.bench import ceilings

    bandwidth = ceilings()[0]  # this device's copy rate (bytes read + written per second), the % column's base
    print(f"{torch.cuda.get_device_name(0)}: copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    b2, b3 = (f"b={m} us" if m else "-" for m in shown)
    print(f"{'proj':12} {'type':5} {'shape':>14} {'MB':>7} {'b=1 us':>8} {'%bw':>5} {b2:>8} {b3:>8} "
          f"{'4096 ms':>8} {'bf16 ms':>8}", flush=True)
    tot = dict(bytes=0.0, pre=0.0, bf=0.0, **{f"dec{m}": 0.0 for m in row_counts})
    for name, n, k, qtype, times in LAYER_SET:
        if args.only and name not in args.only:
            continue
        raw = keep_blocks(random_blocks(qtype, n, k, std=0.02, seed=n + k), qtype, "cuda")
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in row_counts}
        copies = cold_copies(raw)
        dec = {m: _us(lambda w, m=m: quant_linear(xs[m], w, qtype, n), copies) for m in xs}
        pre = bf = 0.0
        if not args.no_prefill:
            xp = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
            wd = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            pre = _us(lambda w: quant_linear(xp, w, qtype, n), [raw]) / 1e3
            bf = _us(lambda w: torch.nn.functional.linear(xp, w), [wd]) / 1e3
            del xp, wd
        nbytes = raw.nbytes
        print(f"{name:12} {qtype:5} {f'{n}x{k}':>14} {nbytes / 1e6:7.1f} {dec[1]:8.1f} "
              f"{100 * nbytes / bandwidth / (dec[1] * 1e-6):5.0f} {dec.get(shown[0], nan):8.1f} "
              f"{dec.get(shown[1], nan):8.1f} {pre:8.2f} {bf:8.2f}", flush=True)
        print(f"  mat-vec configs by rows: {quant_dp4a_triton.tuned_configs(qtype, n, k)}", flush=True)
        for m in row_counts:
            tot[f"dec{m}"] += dec[m] * times
        tot["bytes"] += nbytes * times
        tot["pre"] += pre * times
        tot["bf"] += bf * times
        del raw, copies
    ms = tot["dec1"] / 1e3
    what = "9B Q4_K_M projections" if not args.only else "the chosen projections' share of a 9B token"
    line = (f"{what}: {tot['bytes'] / 1e9:.2f} GB; decode b=1 {ms:.3f} ms/token "
            f"({1e3 / ms:.0f} tok/s bound, {100 * tot['bytes'] / bandwidth / (ms * 1e-3):.0f}% of bandwidth, "
            f"ceiling {bandwidth / tot['bytes']:.0f} tok/s)")
    line += "".join(f"; b={m} {tot[f'dec{m}'] / 1e3:.3f} ms/step ({tot[f'dec{m}'] / tot['dec1']:.2f}x b=1)"
                    for m in row_counts[1:])
    if not args.no_prefill:
        line += (f"; prefill 4096 {tot['pre']:.1f} ms ({4096e3 / tot['pre']:.0f} tok/s bound; "
                 f"bf16 weights {tot['bf']:.1f} ms)")
    print(line, flush=True)

if __name__ == "__main__":
    main()
