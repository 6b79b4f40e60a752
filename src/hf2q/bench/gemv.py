"""Timing of the Triton bf16 GEMV against cuBLAS (F.linear) on the decode projections (CUDA only).

For each 2B and 9B projection as the model runs it (packed: DeltaNet qkv+z+alpha+beta, attention
q+gate/k/v, MLP gate+up; the LM head) at 1, 2 and 4 rows: µs per call and TB/s of weight bytes, for
cuBLAS, the GEMV's default configuration and the best of a sweep (one sweep for one row, one for
2..4 rows, as the two run different kernels). Each timing replays a CUDA graph
that multiplies by enough distinct copies of W to overflow the L2, as a decode step reads cold weights
with no host gaps. Ends with the per-step sums and the TABLE lines for gemv_triton.
Run: python -m hf2q.bench.gemv [--shape 2b 9b] [--quick] [--only lm_head ...]
With --moe (--shape 35b-a3b): the expert kernels of one MoE token instead (bench_moe).
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from hf2q.bench_shapes import SHAPES
from hf2q.kernels.linear.gemv_triton import MAX_ROWS, default_config, gemv
from hf2q.kernels.tuning.timing import graph_time_us, time_configs


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


MOE_SPACE = dict(block_n=(1, 2, 4, 8), block_k=(256, 512, 1024, 2048), warps=(1, 2, 4, 8), stages=(1, 3))


def moe_configs(k: int) -> list[tuple[int, int, int, int]]:
    """One-row configurations for a MoE kernel over K: 8..64 weights per thread per tile (16-byte loads or
    more), a tile no wider than K, pipelined only over three or more K tiles."""
    out = []
    for bn, bk, warps, stages in itertools.product(*MOE_SPACE.values()):
        per_thread = bn * bk // (32 * warps)
        if bk <= max(256, k) and 8 <= per_thread <= 64 and (stages == 1 or k >= 3 * bk):
            out.append((bn, bk, warps, stages))
    return out


def bench_moe(shape: str, quick: bool, device: str = "cuda") -> dict[tuple[str, int, int], tuple]:
    """The MoE kernels of one decode token at a shape's sizes: the k pairs' gate+up with the SwiGLU
    (expert_gemv with two stacks) and their down rows with the shared expert's down and the combine
    (expert_down_combine), each against the fp32 reference, for every configuration of moe_configs (the
    default and a few others with --quick). Every call in a timed graph picks other experts (and another
    copy of the shared down), so weights come from memory as in a step. Returns EXPERT_TABLE entries."""
    from hf2q.kernels.linear.gemv_triton import EXPERT_TABLE, expert_down_combine, expert_gemv

    cfg, _ = SHAPES[shape]
    e, top_k, inter, h = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size
    shared = cfg.shared_expert_intermediate_size
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *size: torch.randn(*size, device=device, dtype=torch.bfloat16, generator=gen) * 0.02  # noqa: E731
    gate, up, down = rand(e, inter, h), rand(e, inter, h), rand(e, h, inter)
    sets = torch.randperm(e, device=device, generator=gen)[: e // top_k * top_k].view(-1, top_k).to(torch.int32)
    x = rand(1, h) * 50
    act, act_shared = rand(top_k, inter) * 50, rand(1, shared) * 50
    gate_logit = rand(1, 1)
    weights = torch.softmax(torch.randn(1, top_k, device=device, generator=gen), -1).to(torch.bfloat16)
    shared_downs = [rand(h, shared) for _ in range(len(sets))]
    glu_ref = torch.cat([F.silu(x.float() @ gate[i].float().T) * (x.float() @ up[i].float().T) for i in sets[0].tolist()])
    down_ref = sum(weights[0, j].float() * (down[i].float() @ act[j].float()) for j, i in enumerate(sets[0].tolist()))
    down_ref = down_ref + torch.sigmoid(gate_logit.float()) * (shared_downs[0].float() @ act_shared[0].float())
    kernels = {
        ("glu", inter, h): (lambda c, w: expert_gemv(x, gate, w[0].view(-1), top_k, second=up, config=c), glu_ref,
                            2 * top_k * inter * h * 2),
        ("down", h, max(inter, shared)): (
            lambda c, w: expert_down_combine(act, down, w[0].view(1, -1), weights, act_shared, w[1], gate_logit,
                                             config=c), down_ref[None], (top_k * inter + shared) * h * 2),
    }
    entries = {}
    for key, (fn, want, nbytes) in kernels.items():
        calls = list(zip(sets, shared_downs))
        default = default_config(key[1], key[2], 1)
        configs = [default] + [c for c in moe_configs(key[2]) if c != default]
        if quick:
            configs = configs[:8]
        print(f"  moe.{key[0]}:")
        ranked_times = time_configs(configs, lambda c: float((fn(c, calls[0]).float() - want).norm() / want.norm()),
                                    lambda c: graph_time_us(lambda w: fn(c, w), calls))
        times = {c: t for t, c in ranked_times}
        ranked = [c for _, c in ranked_times]
        best = ranked[0]
        tbs = lambda us: nbytes / us / 1e6  # noqa: E731
        print(f"  moe.{key[0]:5s} N={key[1]:5d} K={key[2]:5d}  default {default} {times[default]:6.2f} "
              f"({tbs(times[default]):.2f})  best {best} {times[best]:6.2f} ({tbs(times[best]):.2f})  "
              f"[table now: {EXPERT_TABLE.get(key, ('-',))[0]}]")
        print("    fastest: " + ", ".join(f"{c} {times[c]:.2f}" for c in ranked[:6]))
        entries[key] = (best, times[best], times[default])
    del gate, up, down, shared_downs
    if device == "cuda":
        torch.cuda.empty_cache()
    return entries


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=["2b", "9b"], choices=["2b", "9b", "35b-a3b"])
    p.add_argument("--quick", action="store_true", help="a few configurations per shape")
    p.add_argument("--only", nargs="+", default=None, help="time just these projections (names as printed)")
    p.add_argument("--moe", action="store_true", help="time the MoE expert kernels of each MoE shape instead")
    args = p.parse_args(argv)
    if args.moe:
        for shape in args.shape:
            if not SHAPES[shape][0].is_moe:
                p.error(f"--moe: {shape} has no experts")
            print(f"== {shape} MoE kernels at one token: µs per call (TB/s of weight bytes)")
            entries = bench_moe(shape, args.quick)
            print("EXPERT_TABLE entries for src/hf2q/kernels/linear/gemv_triton.py:")
            for key, (cfg, t, d) in entries.items():
                print(f"    {key}: ({cfg}, {t:.2f}, {d:.2f}),  # {shape}")
        return
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
    print("TABLE entries for src/hf2q/kernels/linear/gemv_triton.py:")
    for line in table.values():
        print(line)


if __name__ == "__main__":
    main()
