"""Timing of the Triton bf16 GEMV against cuBLAS (F.linear) on the decode projections (CUDA only).

For each 2B and 9B projection as the model runs it (packed: DeltaNet qkv+z+alpha+beta, attention
q+gate/k/v, MLP gate+up; the LM head) at 1, 2 and 4 rows: µs per call and TB/s of weight bytes, for
cuBLAS, the GEMV's default configuration and the best of a sweep (one sweep for one row, one for
2..4 rows, as the two run different kernels). Each timing replays a CUDA graph
that multiplies by enough distinct copies of W to overflow the L2, as a decode step reads cold weights
with no host gaps. Ends with the per-step sums and the TABLE lines for gemv_triton.
Run: python -m hf2q.kernels.gemv_bench [--shape 2b 9b] [--quick] [--only lm_head ...]
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from hf2q.bench_shapes import SHAPES
from hf2q.kernels.gemv_triton import MAX_ROWS, default_config, gemv
from hf2q.kernels.timing import graph_time_us


def decode_projections(shape: str) -> list[tuple[str, int, int, int]]:
    """(name, N, K, calls per decode step) of one model shape, packed as the fast path packs them."""
    cfg, _ = SHAPES[shape]
    h, n_lin, n_full = cfg.hidden_size, len(cfg.linear_layers), len(cfg.full_attention_layers)
    nv_dv = cfg.linear_num_v_heads * cfg.linear_v_head_dim
    q_dim = cfg.num_heads * cfg.head_dim
    if cfg.is_moe:  # the dense products of an MoE block (its routed experts have kernels of their own)
        shared = cfg.shared_expert_intermediate_size
        ffn = [("moe.router+shared", cfg.num_experts + (1 + 2 * shared if shared else 0), h, cfg.num_layers)]
        ffn += [("moe.shared.down", h, shared, cfg.num_layers)] if shared else []
        # A quantized file keeps the router and shared gate in float and its shared gate+up as blocks: the
        # float two are packed alone. Timed for the table; no part of the bf16 step's sum (0 calls).
        ffn += [("moe.router+gate", cfg.num_experts + 1, h, 0)] if shared else []
    else:
        ffn = [("mlp.gate+up", 2 * cfg.intermediate_size, h, cfg.num_layers),
               ("mlp.down", h, cfg.intermediate_size, cfg.num_layers)]
    return [
        ("gdn.qkv+z+a+b", cfg.conv_channels + nv_dv + 2 * cfg.linear_num_v_heads, h, n_lin),
        ("gdn.out", h, nv_dv, n_lin),
        ("attn.q+g+k+v", 2 * q_dim + 2 * cfg.num_kv_heads * cfg.head_dim, h, n_full),
        ("attn.o", h, q_dim, n_full),
        *ffn,
        ("lm_head", cfg.vocab_size, h, 1),
    ]


ONE_ROW = dict(block_n=(1, 2, 4, 8), block_k=(512, 1024, 2048, 4096), warps=(2, 4, 8), stages=(1, 3))
FEW_ROWS = dict(block_n=(16, 32, 64), block_k=(64, 128, 256), warps=(4, 8), stages=(2, 3, 4, 6))
QUICK = {1: dict(block_n=(1, 2), block_k=(1024, 2048), warps=(4, 8), stages=(1,)),
         MAX_ROWS: dict(block_n=(16, 32, 64), block_k=(128, 256), warps=(4,), stages=(3, 5))}


def sweep_configs(k: int, m: int, quick: bool) -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps, STAGES) to try. One row: 4..64 weights per thread per tile, pipelined
    only when a program walks at least three K tiles. Several rows: tiles whose pipeline fits in 160 KB of
    shared memory."""
    space = QUICK[1 if m == 1 else MAX_ROWS] if quick else (ONE_ROW if m == 1 else FEW_ROWS)
    out = []
    for bn, bk, warps, stages in itertools.product(space["block_n"], space["block_k"], space["warps"],
                                                   space["stages"]):
        if m == 1:
            per_thread = bn * bk // (32 * warps)
            if bk > max(512, 2 * k) or not 4 <= per_thread <= 64 or (stages > 1 and k < 3 * bk):
                continue
        elif bk > k or stages * (bn + 16) * bk * 2 > 160 * 1024:
            continue
        out.append((bn, bk, warps, stages))
    return out


def bench_shape(name: str, n: int, k: int, rows: tuple[int, ...], quick: bool) -> dict:
    """Times of cuBLAS, the default config and every swept config at each row count (the 2..4-row sweep
    runs at MAX_ROWS rows; smaller counts time its winner)."""
    copies = max(2, min(48, math.ceil(256e6 / (n * k * 2))))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
    res = {"cublas": {}, "default": {}, "sweep": {1: {}, MAX_ROWS: {}}, "best": {}}
    for m in sorted(rows, key=lambda r: (r != 1, r != MAX_ROWS)):  # 1, then MAX_ROWS, then the others
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = F.linear(x, weights[0]).float()
        res["cublas"][m] = graph_time_us(lambda w: F.linear(x, w), weights)
        res["default"][m] = graph_time_us(lambda w: gemv(x, w), weights)
        if m not in (1, MAX_ROWS):
            cfg = res["best"][MAX_ROWS][0]
            res["best"][m] = (cfg, graph_time_us(lambda w: gemv(x, w, config=cfg), weights))
            continue
        times = res["sweep"][m]
        for cfg in sweep_configs(k, m, quick):
            try:
                got = gemv(x, weights[0], config=cfg).float()
                err = float((got - want).norm() / want.norm())
                if err > 1e-2:
                    print(f"  {name} M={m} {cfg}: relative error {err:.2e}, skipped")
                    continue
                times[cfg] = graph_time_us(lambda w: gemv(x, w, config=cfg), weights)
            except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is skipped
                print(f"  {name} M={m} {cfg}: {type(e).__name__} {str(e)[:80]}")
        ranked = sorted(times, key=times.get)
        res["best"][m] = (ranked[0], times[ranked[0]])
        print(f"  {name} M={m} fastest: " + ", ".join(f"{c} {times[c]:.1f}" for c in ranked[:4]))
    del weights
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=["2b", "9b"], choices=["2b", "9b", "35b-a3b"])
    p.add_argument("--quick", action="store_true", help="a few configurations per shape")
    p.add_argument("--only", nargs="+", default=None, help="time just these projections (names as printed)")
    args = p.parse_args(argv)
    known = {name for shape in args.shape for name, *_ in decode_projections(shape)}
    if args.only and set(args.only) - known:
        p.error(f"--only: no projection {sorted(set(args.only) - known)} in {args.shape}; known: {sorted(known)}")
    rows = (1, 2, MAX_ROWS)
    table: dict[tuple[int, int, int], str] = {}
    for shape in args.shape:
        totals = {key: {m: 0.0 for m in rows} for key in ("cublas", "default", "best")}
        print(f"== {shape}: µs per call (TB/s of weight bytes)")
        for name, n, k, calls in decode_projections(shape):
            if args.only and name not in args.only:
                continue
            res = bench_shape(name, n, k, rows, args.quick)
            tbs = lambda us: n * k * 2 / us / 1e6  # noqa: E731
            for m in rows:
                (cfg, b), c, d = res["best"][m], res["cublas"][m], res["default"][m]
                totals["cublas"][m] += calls * c
                totals["default"][m] += calls * d
                totals["best"][m] += calls * b
                print(f"  {name:15s} N={n:6d} K={k:5d} M={m}  cuBLAS {c:7.1f} ({tbs(c):.2f})  "
                      f"default {default_config(n, k, m)} {d:7.1f} ({tbs(d):.2f})  best {cfg} {b:7.1f} ({tbs(b):.2f})")
            for m in (1, MAX_ROWS):
                (cfg, b), c = res["best"][m], res["cublas"][m]
                line = f"    ({n}, {k}, {m}): ({cfg}, {b:.1f}, {c:.1f}),  # {shape} {name}"
                table.setdefault((n, k, m), line)
        for m in rows:
            t = totals
            print(f"  {shape} step sum M={m}: cuBLAS {t['cublas'][m] / 1e3:.3f} ms, GEMV default "
                  f"{t['default'][m] / 1e3:.3f} ms, GEMV best {t['best'][m] / 1e3:.3f} ms")
    print("TABLE entries for src/hf2q/kernels/gemv_triton.py:")
    for line in table.values():
        print(line)


if __name__ == "__main__":
    main()
