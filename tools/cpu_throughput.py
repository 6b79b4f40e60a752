"""CPU throughput of the engine on a GGUF file: prefill tokens/s and aggregate decode tokens/s at several
concurrencies (informational; the exact CPU path is not built for speed).

    python tools/cpu_throughput.py MODEL.gguf [--concurrency 1 4 16] [--prompt-len 256] [--decode 32]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

import hf2q
from hf2q.config import CacheConfig
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig


def make_engine(model, seqs: int, max_len: int) -> Engine:
    blocks = seqs * (-(-max_len // 16))
    return Engine(model, EngineConfig(max_model_len=max_len,
                                      scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=4096,
                                                                prefill_chunk=2048),
                                      cache=CacheConfig(num_slots=seqs, num_blocks=blocks, block_size=16)))


def run(engine: Engine, prompts: list[list[int]], decode: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=decode, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    produced = 0
    start = time.perf_counter()
    while engine.has_work():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - start, produced


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = hf2q.load(args.model)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 100000) for _ in range(args.prompt_len)]
    engine = make_engine(model, 1, args.prompt_len + args.decode + 8)
    secs, _ = run(engine, [prompt], 1)
    print(f"model: {args.model}  threads: {torch.get_num_threads()}")
    print(f"prefill {args.prompt_len} tokens: {args.prompt_len / secs:,.0f} tok/s")
    print("| concurrent requests | decode tokens | seconds | aggregate tok/s |")
    print("|---|---|---|---|")
    for c in args.concurrency:
        engine = make_engine(model, c, 16 + args.decode + 8)
        prompts = [[rng.randrange(1000, 100000) for _ in range(16)] for _ in range(c)]
        run(engine, [prompts[0]], 2)  # warm-up
        secs, produced = run(engine, prompts, args.decode)
        print(f"| {c} | {produced} | {secs:.2f} | {produced / secs:,.1f} |")


if __name__ == "__main__":
    main()
