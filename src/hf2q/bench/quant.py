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
    p.add_argument("--moe", type=int, nargs="+", default=None, metavar="TOKENS",
                   help="instead: a 35B-A3B expert layer's SwiGLU experts at these token counts, each pair's "
                        "expert read for it alone against once a block of pairs (HF2Q_MOE_BLOCKS)")
    args = p.parse_args(argv)
    if args.moe:
        return moe_pairs(args.moe)
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


def moe_pairs(token_counts: list[int], experts: int = 256, top_k: int = 8, hidden: int = 2048, inter: int = 512,
              seed: int = 0) -> None:
    """The expert pairs of one 35B-A3B MoE layer (Q4_K gate and up; Q4_K, then Q6_K down, as Q4_K_M gives its
    layers) at each token count, routed at random (top_k distinct experts a token): µs a call read once a pair and
    once a block of pairs, against reading each chosen expert once at the copy rate."""
    from hf2q import envs
    from hf2q.bench import ceilings
    from hf2q.kernels.quant import moe as quant_moe

    bandwidth = ceilings()[0]
    print(f"{torch.cuda.get_device_name(0)}: copy {bandwidth / 1e12:.2f} TB/s; {experts} experts, top {top_k}, "
          f"{hidden} x {inter}", flush=True)
    gen = torch.Generator().manual_seed(seed)
    for down in ("Q4_K", "Q6_K"):
        stacks = [(keep_blocks(random_blocks(t, experts * out, inp, std=0.05, seed=seed + i), t, "cuda")
                   .view(experts, out, -1), t) for i, (out, inp, t) in
                  enumerate([(inter, hidden, "Q4_K"), (inter, hidden, "Q4_K"), (hidden, inter, down)])]
        per_expert = sum(raw.nbytes for raw, _ in stacks) / experts
        print(f"down {down}: {'tokens':>6} {'pairs':>5} {'experts':>7} {'MB read once':>12} {'a pair us':>9} "
              f"{'blocks us':>9} {'ratio':>6} {'%bw':>5}", flush=True)
        for t in token_counts:
            routed = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(t)]).to("cuda")
            x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
            us = {}
            for name, blocks in (("pair", None), ("blocks", 1)):
                quant_moe.MOE_BLOCKS = blocks
                us[name] = _us(lambda w: quant_moe.moe_expert_pairs_quant(x, routed, *w), [stacks])
            used = len(torch.unique(routed))
            once = used * per_expert
            print(f"{'':11} {t:>6} {t * top_k:>5} {used:>7} {once / 1e6:12.1f} {us['pair']:9.1f} {us['blocks']:9.1f} "
                  f"{us['pair'] / us['blocks']:6.2f} {100 * once / bandwidth / (us['blocks'] * 1e-6):5.0f}",
                  flush=True)
        del stacks
    quant_moe.MOE_BLOCKS = envs.moe_blocks()


if __name__ == "__main__":
    main()
