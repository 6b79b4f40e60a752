"""Timing of the paged decode attention (both kernels: the split walk and the merge) at one query per
sequence, for each (splits, keys a step, warps) configuration, at a model shape's attention heads (CUDA only).

Each timing replays a CUDA graph over enough distinct K/V pools to overflow the L2, as a decode step
finds each layer's keys cold. Every configuration is checked against the served one's output first.
--kv-format times the kernel over a compressed pool's stored rows (random K/V encoded by the pool's codec).
Run: python -m hf2q.bench.attention [--shape 35b-a3b 9b] [--context 512 4096] [--kv-format tq8]
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch

from hf2q.bench_shapes import SHAPES
from hf2q.cache.kv_pool import COMPRESSED_FORMATS, make_pool, row_bytes
from hf2q.kernels.attention.paged_triton import config_for, paged_decode_attention
from hf2q.kernels.tuning.timing import describe, graph_time_us, time_configs

SPLITS = (4, 8, 16, 32)
BLOCK_N = (16, 32, 64)
WARPS = (4, 8)
BLOCK_SIZE = 16


def bench_shape(shape: str, context: int, batch: int = 1,
                kv_format: str = "bfloat16") -> list[tuple[float, tuple[int, int, int]]]:
    """(µs, (splits, block_n, warps)) of every configuration, fastest first; the served one (config_for) is
    printed beside the best. (HF2Q_PAGED_DECODE=S,N,W makes a configuration the served one.)"""
    coded = kv_format in COMPRESSED_FORMATS
    served_config = config_for(batch, coded)
    cfg, _ = SHAPES[shape]
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = batch * math.ceil(context / BLOCK_SIZE)
    pool_bytes = 2 * blocks * BLOCK_SIZE * nkv * row_bytes(kv_format, hd)
    copies = max(2, min(32, math.ceil(256e6 / pool_bytes)))
    coder = make_pool(kv_format, 1, 1, BLOCK_SIZE, nkv, hd, torch.device("cuda")) if coded else None

    def stored_rows():
        x = torch.randn(blocks * BLOCK_SIZE, nkv, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
        return coder.encode(x) if coded else x

    pools = [(stored_rows(), stored_rows()) for _ in range(copies)]
    q = torch.randn(batch, nh, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate = torch.randn(batch, nh, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
    tables = torch.randperm(blocks, device="cuda", generator=gen).view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)

    def run(kv, config):
        splits, block_n, warps = config
        return paged_decode_attention(q, kv[0], kv[1], tables, lens, BLOCK_SIZE, hd ** -0.5, num_splits=splits,
                                      gate=gate, block_n=block_n, num_warps=warps,
                                      kv_format=kv_format if coded else None)

    want = run(pools[0], served_config).float()
    times = time_configs(itertools.product(SPLITS, BLOCK_N, WARPS),
                         lambda c: float((run(pools[0], c).float() - want).norm() / want.norm()),
                         lambda c: graph_time_us(lambda kv: run(kv, c), pools))
    print(f"  {shape} context {context} batch {batch} K/V {kv_format} (heads {nh}/{nkv}, dim {hd}): "
          + describe(times, served_config, "served"))
    del pools
    torch.cuda.empty_cache()
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=["35b-a3b", "9b"], choices=sorted(SHAPES))
    p.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--kv-format", default="bfloat16", choices=("bfloat16",) + COMPRESSED_FORMATS,
                   help="the pool's stored rows the kernel reads")
    args = p.parse_args(argv)
    if min(args.context) < 1:
        p.error("--context: token counts of at least 1")
    for shape in args.shape:
        for context in args.context:
            best = bench_shape(shape, context, kv_format=args.kv_format)[0][1]
            print(f"BEST {shape} {context} {','.join(map(str, best))}")  # HF2Q_PAGED_DECODE's form


if __name__ == "__main__":
    main()
