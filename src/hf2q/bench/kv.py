"""`python -m hf2q.bench.kv`: what each K/V format buys at a real shape: bytes per token, the most 32k-token
sequences the server's sizing admits at once, and decode tok/s at 1 and 64 streams at 4k and 32k contexts (CUDA).

Contexts are filled by writing random K/V through the pool (the attention cost depends on the length, not the
values); decode replays a captured CUDA graph of exactly the streams, as the server decodes, for every format
(the compressed ones through their store and paged decode kernels), so the figures compare formats on the
served path.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from hf2q.bench_shapes import QUANT_MIXES, SHAPES, random_model, random_quant_model
from hf2q.cache.hybrid import HybridCache, kv_bytes_per_token
from hf2q.config import CacheConfig
from hf2q.server.sizing import BLOCK, choose

FORMATS = ("bfloat16", "fp8", "tq8", "tq6", "tq5")


def capacity(cfg, fmt: str, free_bytes: int, total_bytes: int, context: int) -> dict:
    """Bytes per token, and the most sequences of `context` tokens the server's sizing admits at once in
    `free_bytes`: the largest --max-num-seqs whose pool (after its DeltaNet states and the reserve) holds
    every sequence at full length."""
    per_seq = -(-context // BLOCK)

    def fits(seqs: int) -> bool:
        try:
            limits = choose(cfg, "cuda", fmt, seqs, context, free_bytes=free_bytes, total_bytes=total_bytes)
        except ValueError:
            return False
        return limits.cache.num_blocks >= seqs * per_seq

    lo, hi = 0, 1 << 14
    while lo < hi:  # fits() is monotone: each sequence takes its state and its blocks
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return {"bytes_per_token": kv_bytes_per_token(cfg, fmt), "max_seqs": lo}


def _fill(cache: HybridCache, slots: list[int], context: int) -> None:
    mc, gen = cache.model_config, torch.Generator(device="cuda").manual_seed(0)
    for s in slots:
        cache.reserve(s, context + 64)
        rows = cache.token_indices(s, 0, context)
        for layer in range(mc.num_kv_layers):
            k = torch.randn(context, mc.num_kv_heads, mc.head_dim, device="cuda", generator=gen,
                            dtype=torch.bfloat16)
            cache.kv.store(layer, rows, k, k)
        cache.commit(s, context)


@torch.inference_mode()
def decode_tok_s(net, fmt: str, streams: int, context: int, steps: int) -> float:
    from hf2q.engine.cuda_graphs import DecodeGraphs

    cfg = net.config
    blocks = streams * -(-(context + 64) // BLOCK) + 1
    # one more slot and block: the graphs' padding slot
    cache = HybridCache(cfg, CacheConfig(num_slots=streams + 1, num_blocks=blocks + 1, block_size=BLOCK,
                                         kv_dtype=fmt), device="cuda")
    slots = [cache.acquire() for _ in range(streams)]
    _fill(cache, slots, context)
    graphs = DecodeGraphs(net, cache, buckets=(streams,), max_context=context + 64)
    ids = torch.zeros(streams, dtype=torch.long, device="cuda")
    pos = [context] * streams
    for i in range(steps + 2):
        if i == 2:  # two warm-up steps (the first captures the graph)
            torch.cuda.synchronize()
            t = time.perf_counter()
        ids = graphs.step(ids, pos, slots).argmax(-1)
        pos = [p + 1 for p in pos]
    torch.cuda.synchronize()
    return streams * steps / (time.perf_counter() - t)


def decode_points(measure, streams: list[int], contexts: list[int]) -> dict:
    """`measure(streams, context)` (tok/s) at every point, by key decode_{s}x{c}_tok_s; a point whose pool does not
    fit in the GPU's memory is None and a line, so the others are still measured (64 sequences of 32k tokens in
    bf16 are 64 GiB of K/V: an 80-GB card holds them only in the compressed formats)."""
    row = {}
    for s in streams:
        for c in contexts:
            key = f"decode_{s}x{c}_tok_s"
            try:
                row[key] = round(measure(s, c), 1)
            except torch.OutOfMemoryError:
                row[key] = None
                print(f"{s} x {c} tokens: does not fit in this GPU's memory", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf2q.bench.kv", description=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--quant", choices=QUANT_MIXES, default=None,
                   help="weights as random GGUF blocks of this mix (a 9B Q4_K_M leaves an 80-GB card room for 64 "
                        "sequences of 32k tokens in bf16 K/V)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per point")
    p.add_argument("--free-gib", type=float, default=None, help="size against this much free memory (default: the "
                                                                 "GPU's after loading the model; 120 without CUDA)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cfg = SHAPES[args.shape][0]
    cuda = torch.cuda.is_available()
    net = None
    if cuda:
        net = (random_quant_model(cfg, args.quant, device="cuda", dtype=torch.bfloat16) if args.quant
               else random_model(cfg, device="cuda", dtype=torch.bfloat16))
    free, total = torch.cuda.mem_get_info() if cuda else (120 << 30, 141 << 30)
    if args.free_gib is not None:
        free = int(args.free_gib * (1 << 30))
    report = {}
    for fmt in args.formats:
        row = capacity(cfg, fmt, free, total, 32768)
        if cuda:
            row.update(decode_points(lambda s, c: decode_tok_s(net, fmt, s, c, args.steps), args.streams,
                                     args.contexts))
        report[fmt] = row | {"weights": args.quant or "bf16"}
        print(fmt, json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
