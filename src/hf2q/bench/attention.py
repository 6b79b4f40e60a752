"""Timing of the paged decode attention (both kernels: the split walk and the merge) at one query per
sequence, for each (splits, keys a step, warps) configuration, at a model shape's attention heads (CUDA only).

Each timing replays a CUDA graph over enough distinct K/V pools to overflow the L2, as a decode step
finds each layer's keys cold. Every configuration is checked against the served one's output first.
--kv-format times the kernel over each pool format's stored rows (random K/V encoded by the pool's codec) and
compares each format's fastest and served configurations with the first format's fastest, at every context and
batch (sequences a step). --rows R gives each sequence R rows, each a query at its own position (the last at the
context), as a small prefill step replayed in a graph has them (a chat follow-up's rows over a cached history);
its configurations take a fourth number, a program's tile rows (GROUPED_TILE: how many of a sequence's rows share
a read of its keys).
Run: python -m hf2q.bench.attention [--shape 35b-a3b 9b] [--context 512 4096] [--batch 1 64]
     [--kv-format bfloat16 fp8 tq8] [--rows 41]
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch

from hf2q.bench_shapes import SHAPES
from hf2q.cache.kv_pool import COMPRESSED_FORMATS, make_pool, row_bytes
from hf2q.kernels.attention.paged_triton import GROUPED_TILE, config_for, grouped_config_for, paged_decode_attention
from hf2q.kernels.tuning.timing import describe, graph_time_us, time_configs

SPLITS = (4, 8, 16, 32)
BLOCK_N = (16, 32, 64)
WARPS = (4, 8)
BLOCK_SIZE = 16


def bench_shape(shape: str, context: int, batch: int = 1, kv_format: str = "bfloat16",
                rows: int = 1, configs=None) -> list[tuple[float, tuple[int, ...]]]:
    """(µs, (splits, block_n, warps[, tile rows])) of every configuration, fastest first; the served one
    (config_for, and GROUPED_TILE with rows) is printed beside the best. (HF2Q_PAGED_DECODE=S,N,W makes a
    configuration the served one.) rows: each sequence's query rows, at positions context - rows + 1 .. context,
    a grouped step (the configurations' fourth number its tile rows). configs: (splits, keys, warps[, tile rows])
    to time (default: every product of SPLITS, BLOCK_N and WARPS, with the served tile)."""
    coded = kv_format in COMPRESSED_FORMATS
    cfg, _ = SHAPES[shape]
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    served_config = served(batch, rows, nh, nkv, coded)
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = batch * math.ceil(context / BLOCK_SIZE)
    pool_bytes = 2 * blocks * BLOCK_SIZE * nkv * row_bytes(kv_format, hd)
    copies = max(2, min(32, math.ceil(256e6 / pool_bytes)))
    coder = make_pool(kv_format, 1, 1, BLOCK_SIZE, nkv, hd, torch.device("cuda")) if coded else None

    def stored():
        """A pool's K and V as the kernel reads them: (k rows, v rows, k side, v side); dense: no side values."""
        k, v = (torch.randn(blocks * BLOCK_SIZE, nkv, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        if not coded:
            return k, v, None, None
        (k, k_side), (v, v_side) = coder.encode(k), coder.encode(v)
        return k, v, k_side, v_side

    pools = [stored() for _ in range(copies)]
    q = torch.randn(batch * rows, nh, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate = torch.randn(batch * rows, nh, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
    tables = torch.randperm(blocks, device="cuda", generator=gen).view(batch, -1).to(torch.int32)
    tables = tables.repeat_interleave(rows, 0)  # each row of a sequence with its table
    lens = (context - rows + 1 + torch.arange(rows, device="cuda", dtype=torch.int32)).repeat(batch)
    firsts = torch.arange(0, batch * rows, rows, device="cuda").repeat_interleave(rows) if rows > 1 else None

    def run(kv, config):
        splits, block_n, warps, *tile = config
        return paged_decode_attention(q, kv[0], kv[1], tables, lens, BLOCK_SIZE, hd ** -0.5, num_splits=splits,
                                      gate=gate, block_n=block_n, num_warps=warps,
                                      kv_format=kv_format if coded else None, k_side=kv[2], v_side=kv[3],
                                      row_firsts=firsts, group_tile=tile[0] if tile else None)

    want = run(pools[0], served_config).float()
    configs = configs or list(itertools.product(SPLITS, BLOCK_N, WARPS, *[[GROUPED_TILE]] * (rows > 1)))
    times = time_configs(dict.fromkeys([served_config, *configs]),
                         lambda c: float((run(pools[0], c).float() - want).norm() / want.norm()),
                         lambda c: graph_time_us(lambda kv: run(kv, c), pools))
    print(f"  {shape} context {context} batch {batch}" + (f" x {rows} rows" if rows > 1 else "")
          + f" K/V {kv_format} (heads {nh}/{nkv}, dim {hd}): "
          + describe(times, served_config, "served"))
    del pools
    torch.cuda.empty_cache()
    return times


def served(batch: int, rows: int, nh: int, nkv: int, coded: bool) -> tuple[int, ...]:
    """The configuration the server takes for `batch` sequences of `rows` rows (a grouped step's with its tile)."""
    if rows == 1:
        return config_for(batch, coded)
    return grouped_config_for(batch * rows, nh // nkv, nkv, coded) + (GROUPED_TILE,)


def comparison(times: dict[str, list[tuple[float, tuple[int, int, int]]]], served: dict[str, tuple[int, int, int]]
               ) -> list[str]:
    """One line per format: its fastest configuration and the served one, each against the first format's fastest
    (times: format → bench_shape's list, fastest first; served: format → its served configuration)."""
    base_name, base = next(iter(times.items()))
    base_us = base[0][0]
    lines = []
    for fmt, fmt_times in times.items():
        best_us, best = fmt_times[0]
        line = f"{fmt}: fastest {best} {best_us:.2f} µs ({best_us / base_us - 1:+.1%} against {base_name}'s fastest)"
        served_us = [t for t, c in fmt_times if c == served[fmt]]
        if served_us:
            line += f", served {served[fmt]} {served_us[0]:.2f} µs ({served_us[0] / base_us - 1:+.1%})"
        lines.append(line + ("" if served_us else f", served {served[fmt]} not among the timed"))
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=["35b-a3b", "9b"], choices=sorted(SHAPES))
    p.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="sequences a step")
    p.add_argument("--kv-format", nargs="+", default=["bfloat16"], choices=("bfloat16",) + COMPRESSED_FORMATS,
                   help="the pool formats whose stored rows the kernel reads (the first is the yardstick)")
    p.add_argument("--rows", type=int, default=1, help="query rows a sequence (a small prefill step's)")
    p.add_argument("--configs", nargs="+", metavar="S,N,W[,T]",
                   help="only these (splits, keys a step, warps[, tile rows of a grouped step: with --rows])")
    args = p.parse_args(argv)
    if min(args.context) < 1 or min(args.batch) < 1 or not 1 <= args.rows <= min(args.context):
        p.error("--context, --batch and --rows: counts of at least 1, --rows at most the context")
    try:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs or []]
    except ValueError:
        configs = []
    sizes = (3, 4) if args.rows > 1 else (3,)
    if any(len(c) not in sizes or min(c) < 1 for c in configs) or len(configs) != len(args.configs or []):
        p.error("--configs: splits,keys,warps triples of positive integers, e.g. 16,32,4 (with --rows, a fourth: "
                "the tile rows, e.g. 16,32,4,64)")
    if args.rows > 1:  # a triple takes the served tile
        configs = [c + (GROUPED_TILE,) * (4 - len(c)) for c in configs]
    for shape in args.shape:
        for context in args.context:
            for batch in args.batch:
                times = {fmt: bench_shape(shape, context, batch, fmt, args.rows, configs)
                         for fmt in dict.fromkeys(args.kv_format)}
                for fmt, fmt_times in times.items():  # HF2Q_PAGED_DECODE's form
                    print(f"BEST {shape} {context} {batch} {fmt} {','.join(map(str, fmt_times[0][1]))}")
                cfg = SHAPES[shape][0]
                served_configs = {fmt: served(batch, args.rows, cfg.num_heads, cfg.num_kv_heads,
                                              fmt in COMPRESSED_FORMATS) for fmt in times}
                for line in comparison(times, served_configs):
                    print(f"COMPARE {shape} {context} {batch} {line}")


if __name__ == "__main__":
    main()
