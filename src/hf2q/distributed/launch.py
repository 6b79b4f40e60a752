"""Start N tensor-parallel ranks on this host and generate greedily; rank 0 prints the tokens as JSON.

    python -m hf2q.distributed.launch --nproc 2 --model m.gguf --prompt-tokens 1,2,3 --max-tokens 8

Each rank is a process (torch.multiprocessing) in one gloo group over 127.0.0.1; `torchrun` users call
`generate_tp` from their own entry point instead.
"""
from __future__ import annotations

import argparse
import datetime
import json
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf2q.config import CacheConfig
from hf2q.distributed.engine import TPEngine, serve_worker
from hf2q.distributed.sharding import shard_model
from hf2q.engine.engine import EngineConfig
from hf2q.engine.sampling_params import SamplingParams
from hf2q.model import Model


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world: int, *args, start_method: str = "spawn", backend: str = "gloo",
              timeout_s: float = 300) -> None:
    """Run `fn(rank, world, group, *args)` in `world` local processes joined in one process group.

    With start_method="fork" the arguments (e.g. a loaded Model) are inherited, not pickled.
    """
    port = free_port()
    mp.start_processes(_entry, args=(world, port, backend, timeout_s, fn, args), nprocs=world,
                       start_method=start_method)


def _entry(rank: int, world: int, port: int, backend: str, timeout_s: float, fn, args) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, dist.group.WORLD, *args)
    finally:
        dist.destroy_process_group()


def generate_tp(model: Model, rank: int, world: int, group, prompts: list[list[int]], params: SamplingParams,
                config: EngineConfig = EngineConfig(), warm_up: bool = False) -> list[list[int]] | None:
    """Shard `model` for this rank and run the prompts together; rank 0 returns each one's tokens. With
    `warm_up`, the group first serves the server warm-up's throwaway requests (on every device)."""
    local = shard_model(model, rank, world, group)
    if rank != 0:
        serve_worker(local, config, group)
        return None
    engine = TPEngine(local, config, group)
    try:
        if warm_up:
            engine.warm_up_requests()
        reqs = [engine.add_request(p, params, request_id=str(i)) for i, p in enumerate(prompts)]
        tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
    finally:
        engine.close()
    return [tokens[r.request_id] for r in reqs]


def _cli_rank(rank: int, world: int, group, args: argparse.Namespace) -> None:
    import hf2q

    torch.set_num_threads(max(1, args.threads))
    model = hf2q.load(args.model, with_mtp=False)
    prompts = [[int(t) for t in p.split(",")] for p in args.prompt_tokens]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    config = EngineConfig(max_model_len=args.max_model_len,
                          cache=CacheConfig(num_slots=max(len(prompts), 1), num_blocks=args.num_blocks))
    tokens = generate_tp(model, rank, world, group, prompts, params, config)
    if rank == 0:
        print(json.dumps({"tensor_parallel_size": world, "tokens": tokens}), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hf2q.distributed.launch", description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, required=True, help="tensor-parallel size (processes)")
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--prompt-tokens", nargs="+", required=True, help="comma-separated token ids, one per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args(argv)
    if args.nproc < 1:
        ap.error("--nproc must be at least 1")
    run_ranks(_cli_rank, args.nproc, args)


if __name__ == "__main__":
    main()
