"""Timing of the DeltaNet decode step with the causal conv folded in (gdn_decode_triton.gdn_conv_decode_:
the column kernel and the finish kernel) at a batch of sequences (one by default), for each (column parts a
head, warps of each kernel) configuration, at a model shape's DeltaNet heads, on an fp32 or bf16 recurrent
state pool (CUDA only).

Each timing replays a CUDA graph over enough distinct state pools to overflow the L2, as a decode step
finds each layer's recurrent state cold. Every configuration is first run on copies of the same inputs and
checked against the default's output and new state.
With --verify-rows, instead the step of a prefill graph or a speculative verify (gdn/verify_triton.gdn_verify_:
each sequence several rows, walked in order) at those row counts a sequence.
Run: python -m hf2q.bench.gdn [--shape 9b 35b-a3b] [--int8-for Q4_K] [--batch 64] [--state-dtype bfloat16]
     [--verify-rows 4 41 127]
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch

from hf2q.bench_shapes import SHAPES
from hf2q.config import STATE_DTYPES
from hf2q.kernels.gdn.decode_triton import DEFAULT_CONFIG as DEFAULT, gdn_conv_decode_
from hf2q.kernels.gdn.verify_triton import COLUMNS_CONFIG, COLUMNS_CONFIGS, gdn_verify_
from hf2q.kernels.quant.dequant_triton import QTYPE_ID
from hf2q.kernels.tuning.timing import describe, graph_time_us, time_configs

SPLITS = (2, 4, 8, 16)
WARPS = (1, 2, 4, 8)


def _inputs(shape: str, gen: torch.Generator, batch: int = 1, state_dtype: torch.dtype = torch.float32) -> dict:
    cfg, _ = SHAPES[shape]
    nk, nv = cfg.linear_num_k_heads, cfg.linear_num_v_heads
    dk, dv = cfg.linear_k_head_dim, cfg.linear_v_head_dim
    c = cfg.conv_channels

    def rand(*size, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*size, device="cuda", generator=gen) * scale).to(dtype)

    b = batch
    return dict(x=rand(b, c), conv_w=rand(c, 4, dtype=torch.float32, scale=0.5),
                conv_pool=rand(b, 3, c, dtype=torch.float32), a_raw=rand(b, nv), b_raw=rand(b, nv),
                A=-torch.rand(nv, device="cuda", generator=gen) * 8, dt_bias=rand(nv, dtype=torch.float32),
                z=rand(b, nv * dv), norm_w=rand(dv, dtype=torch.float32),
                state_pool=rand(b, nv, dk, dv, dtype=state_dtype, scale=0.1),
                slots=torch.arange(b, dtype=torch.int64, device="cuda"), nk=nk, dk=dk, eps=1e-6,
                out_dtype=torch.bfloat16)


def bench_shape(shape: str, int8_for: str | None, batch: int = 1, state_dtype: torch.dtype = torch.float32,
                finish_warps: tuple[int, ...] = WARPS) -> list[tuple[float, tuple[int, int, int]]]:
    """(µs, config) of every configuration, fastest first; the default is printed beside the best."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    args = _inputs(shape, gen, batch, state_dtype)

    def run(a, config):
        return gdn_conv_decode_(**a, int8_for=int8_for, config=config)

    def fresh():
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}

    ref_args = fresh()
    want = run(ref_args, DEFAULT).float()
    copies = max(2, min(64, math.ceil(256e6 / args["state_pool"].nbytes)))
    pools = [fresh() for _ in range(copies)]

    def error_of(config):
        mine = fresh()
        got = run(mine, config).float()
        state = ref_args["state_pool"]
        new = (mine["state_pool"].float() - state.float()).norm() / state.float().norm()
        return max(float((got - want).norm() / want.norm()), float(new))

    times = time_configs(itertools.product(SPLITS, WARPS, finish_warps), error_of,
                         lambda c: graph_time_us(lambda a: run(a, c), pools))
    print(f"  {shape} DeltaNet step of {batch} sequences, {state_dtype} state (int8 rows for {int8_for}): "
          + describe(times, DEFAULT, "default"))
    del pools
    torch.cuda.empty_cache()
    return times


def bench_verify(shape: str, rows: int, batch: int = 1, state_dtype: torch.dtype = torch.float32) -> float:
    """µs of one verify-kernel step (the columns and the conv kernel) over `batch` sequences of `rows` rows,
    keeping nothing (a prefill graph's step; a verify of k drafts keeps k states, a small part of its time), at
    the fastest of the columns kernel's configurations (each checked against the default's read-outs)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    one = _inputs(shape, gen, batch * rows, state_dtype)
    c, nv = one["x"].shape[1], one["state_pool"].shape[1]
    args = dict(x=one["x"], conv_w=one["conv_w"], conv_pool=one["conv_pool"][:batch].clone(), a_raw=one["a_raw"],
                b_raw=one["b_raw"], A=one["A"], dt_bias=one["dt_bias"],
                state_pool=one["state_pool"][:batch].clone(), slots=one["slots"][:batch].clone(),
                cu_seqlens=torch.arange(0, batch * rows + 1, rows, device="cuda"), live=batch,
                kept_conv=torch.empty(0, 3, c, device="cuda"),
                kept_rec=torch.empty(0, nv, one["dk"], one["dk"], device="cuda", dtype=state_dtype), nk=one["nk"],
                dk=one["dk"], eps=1e-6)

    def fresh():
        return {**args, "state_pool": args["state_pool"].clone(), "conv_pool": args["conv_pool"].clone()}

    pools = [fresh() for _ in range(max(2, min(64, math.ceil(256e6 / args["state_pool"].nbytes))))]
    want = gdn_verify_(**fresh(), config=COLUMNS_CONFIG)

    def error_of(config):
        return float((gdn_verify_(**fresh(), config=config) - want).norm() / want.norm())

    times = time_configs(COLUMNS_CONFIGS, error_of,
                         lambda c: graph_time_us(lambda a: gdn_verify_(**a, config=c), pools))
    print(f"  {shape} DeltaNet verify step, {batch} x {rows} rows, {state_dtype} state (column parts, warps): "
          + describe(times, COLUMNS_CONFIG, "default"))
    return times[0][0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=["9b", "35b-a3b"], choices=sorted(SHAPES))
    p.add_argument("--int8-for", default=None, choices=sorted(QTYPE_ID),
                   help="also write int8 rows for a weight of this type")
    p.add_argument("--batch", type=int, default=1, help="sequences a step (each its own slot)")
    p.add_argument("--state-dtype", default="float32", choices=STATE_DTYPES)
    p.add_argument("--finish-warps", type=int, nargs="+", default=list(WARPS),
                   help="the finish kernel's warps to try (fewer: fewer kernels to compile)")
    p.add_argument("--verify-rows", type=int, nargs="+", metavar="N",
                   help="time the verify/prefill-graph step at N rows a sequence instead")
    args = p.parse_args(argv)
    if args.verify_rows:
        for shape, rows in itertools.product(args.shape, args.verify_rows):
            bench_verify(shape, rows, args.batch, getattr(torch, args.state_dtype))
        return
    for shape in args.shape:
        best = bench_shape(shape, args.int8_for, args.batch, getattr(torch, args.state_dtype),
                           tuple(args.finish_warps))[0][1]
        print(f"BEST {shape} {','.join(map(str, best))}")


if __name__ == "__main__":
    main()
