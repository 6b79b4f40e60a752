"""Where a served request's first token waits: one streamed request's chunk timeline, and the engine's steps.

    python tools/ttft_trace.py --url http://127.0.0.1:8090 [--prompt-tokens 64 --max-tokens 32]
    python tools/ttft_trace.py --model F.gguf [--profile] [serve flags]  # in-process, the engine `hf2q serve` builds

`--url` prints when each SSE chunk of one streaming `/v1/completions` request arrived and how much text it
carried (a chunk without text does not count as a first token for `hf2q bench serve`). `--model` times each
engine step of a few requests (prefill step, then decode steps, synchronised) and with `--profile` prints the
profiler's top kernels and host calls of one request; `--concurrent N` then does the same for N sequences
decoding together; `--burst N` times the steps that take N requests arriving at once to their first tokens
(twice: the engine's first burst, then another) and profiles the second.
"""
from __future__ import annotations

import argparse
import json
import logging
import time


def chunk_timeline(url: str, prompt_tokens: int, max_tokens: int) -> None:
    import httpx

    from hf2q.loadgen import parse_sse_line

    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": " hello" * prompt_tokens, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    for attempt in range(2):
        t0 = time.perf_counter()
        rows = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                payload = parse_sse_line(line)
                if payload is None or payload == "[DONE]":
                    continue
                text = "".join(c.get("text") or "" for c in payload.get("choices") or [])
                rows.append((time.perf_counter() - t0, len(text), repr(text[:16]), payload.get("usage")))
        print(f"request {attempt}: {len(rows)} chunks")
        for t, n, text, usage in rows[:12] + rows[-2:]:
            print(f"  {t * 1000:9.1f} ms  {n:3d} chars {text}{'  usage ' + json.dumps(usage) if usage else ''}")


def engine_steps(model_path: str, prompt_tokens: int, max_tokens: int, requests: int, profile: bool,
                 max_num_seqs: int | None, concurrent: int = 0, history: int = 0,
                 serve_args: tuple[str, ...] = (), burst: int = 0) -> None:
    import random

    import torch

    import hf2q
    from hf2q.devices import resolve_device, resolve_dtype
    from hf2q.engine.engine import Engine
    from hf2q.engine.sampling_params import SamplingParams
    from hf2q.server import launch
    from hf2q.spec.proposer import spec_config

    parser = argparse.ArgumentParser()
    launch.add_serve_args(parser)
    args = parser.parse_args(["--model", model_path, *(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []),
                              *serve_args])
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    t0 = time.perf_counter()
    model = hf2q.load(model_path, device=device, dtype=dtype, keep_quantized=launch.keep_quantized(args))
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    if args.batched_weights != "quantized":  # as `hf2q serve` does: steps of 16+ rows on dense copies where they fit
        from hf2q.server.dense_copies import keep_dense_weights
        keep_dense_weights(model.net, device, dtype, asked=args.batched_weights == "dense")
    engine = Engine(model, launch.sized_engine_config(args, model, device, dtype, spec_config(args)))
    t0 = time.perf_counter()
    engine.warm_up()
    print(f"warmed up in {time.perf_counter() - t0:.1f} s")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def one(tag: str) -> None:
        ids = [rng.randrange(1000, 100000) for _ in range(prompt_tokens)]
        engine.add_request(ids, params)
        steps = []
        while engine.has_work():
            t = time.perf_counter()
            engine.step()
            sync()
            steps.append((time.perf_counter() - t) * 1000)
        first = steps[0]
        print(f"{tag}: first step {first:.1f} ms, then {len(steps) - 1} steps: median "
              f"{sorted(steps[1:])[len(steps[1:]) // 2] if steps[1:] else 0:.2f} ms, max {max(steps[1:] or [0]):.2f}")

    if burst:  # before any single request: the engine's first burst, as a served load meets it
        burst_steps(engine, burst, prompt_tokens, rng, sync, profile)
    for i in range(requests):
        one(f"request {i}")
    if history:
        hit_steps(engine, history, prompt_tokens, rng, sync, profile)
    if concurrent > 1:
        batch_steps(engine, concurrent, prompt_tokens, rng, sync, profile)
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            one("profiled")
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


def hit_steps(engine, history: int, suffix: int, rng, sync, profile: bool) -> None:
    """A follow-up turn: a `history`-token request, then its prompt + answer + `suffix` new tokens, timed step by
    step with the prefix cache (a hit on the finished request's checkpoint) and again with the cache emptied
    (cold); --profile profiles the hit."""
    from hf2q.engine.sampling_params import SamplingParams

    def run(ids: list[int], max_tokens: int) -> tuple[list[int], list[float], int]:
        engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        out, steps, cached = [], [], 0
        while engine.has_work():
            t = time.perf_counter()
            for o in engine.step():
                out += o.new_token_ids
                cached = max(cached, o.num_cached_tokens)
            sync()
            steps.append((time.perf_counter() - t) * 1000)
        return out, steps, cached

    def to_first_token(steps: list[float], max_tokens: int) -> list[float]:
        return steps[:len(steps) - (max_tokens - 1)]  # the steps before the first token, not the decode steps

    first = [rng.randrange(1000, 100000) for _ in range(history)]
    answer, steps, _ = run(first, 16)
    print(f"history of {history} tokens: {len(steps)} steps, {sum(to_first_token(steps, 16)):.1f} ms to the "
          "first token")
    follow = first + answer + [rng.randrange(1000, 100000) for _ in range(suffix)]
    for tag in ("hit", "cold"):
        if tag == "cold":
            engine.prefix.clear()
        profiling = tag == "hit" and profile
        with stack_profile(profiling) as prof:
            _, steps, cached = run(follow, 4)
        if profiling:
            print_stack_profile(prof)
        prefill = to_first_token(steps, 4)
        print(f"follow-up {tag}: {len(follow)} tokens, {cached} cached, {len(prefill)} prefill steps, "
              f"{sum(prefill):.1f} ms to the first token ({', '.join(f'{t:.1f}' for t in prefill[:6])})")


def stack_profile(on: bool):
    """A profiler of the CPU (and CUDA, graph replays' kernels included) that records Python stacks; with `on`
    false, a context that does nothing (and gives None)."""
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    if not on:
        return contextlib.nullcontext()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return torch_profile(activities=acts, with_stack=True,
                         experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True))


def print_stack_profile(prof) -> None:
    """A `stack_profile`'s top kernels (on CUDA), its top host calls and the call sites of its copies."""
    import torch

    if torch.cuda.is_available():
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    print_copy_sites(prof)


def print_copy_sites(prof, top: int = 8) -> None:
    """The Python call sites of the profiled steps' copies and scalar reads, longest host time first: a copy
    between host and device from unpinned memory, or a read of a device value, waits for the stream."""
    kinds = ("aten::copy_", "aten::_local_scalar_dense", "aten::nonzero")
    sites: dict[tuple, list[float]] = {}
    for e in prof.events():
        if e.name in kinds and e.stack:
            sites.setdefault((e.name, *e.stack[:6]), []).append(e.cpu_time_total)
    for (name, *stack), times in sorted(sites.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{name} x{len(times)}, {sum(times) / 1000:.2f} ms host: " + " <- ".join(stack))


def burst_steps(engine, n: int, prompt_tokens: int, rng, sync, profile: bool) -> None:
    """n requests added at once, stepped until each has its first token: every step's sequences, tokens and
    time, for the engine's first burst and for a second one; --profile profiles the second (kernels, host calls
    and the call sites of copies and scalar reads)."""
    from hf2q.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for tag in ("first burst", "second burst"):
        for _ in range(n):
            engine.add_request([rng.randrange(1000, 100000) for _ in range(prompt_tokens)], params)
        profiling = profile and tag == "second burst"
        started, steps = set(), []
        with stack_profile(profiling) as prof:
            t0 = time.perf_counter()  # after the profiler's start
            while len(started) < n and engine.has_work():
                t = time.perf_counter()
                started.update(o.request_id for o in engine.step() if o.new_token_ids)
                sync()
                seqs, tokens = engine.last_batch
                steps.append(f"{seqs} seqs/{tokens} tokens {(time.perf_counter() - t) * 1000:.1f} ms")
            took = time.perf_counter() - t0  # before the profiler's stop
        print(f"{tag} of {n} x {prompt_tokens} tokens: every first token after {took * 1000:.1f} ms; "
              f"steps: {'; '.join(steps)}")
        if profiling:
            print_stack_profile(prof)
        while engine.has_work():
            engine.step()


def batch_steps(engine, n: int, prompt_tokens: int, rng, sync, profile: bool) -> None:
    """n requests decoding together: the step time once all are in decode, and (--profile) where it goes."""
    from hf2q.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for _ in range(n):
        engine.add_request([rng.randrange(1000, 100000) for _ in range(prompt_tokens)], params)
    started: set[str] = set()
    while len(started) < n and engine.has_work():  # until every request has its first token
        started.update(o.request_id for o in engine.step())
    print(f"{n} requests in; the last step ran {engine.last_batch[0]} sequences, {engine.last_batch[1]} tokens")
    times = []
    for _ in range(16):
        t = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - t) * 1000)
    print(f"{n} sequences decoding: step median {sorted(times)[len(times) // 2]:.2f} ms, min {min(times):.2f}")
    if profile:
        import torch
        from torch.profiler import ProfilerActivity, profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with torch_profile(activities=acts) as prof:
            for _ in range(8):
                engine.step()
            sync()
        key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))
    while engine.has_work():
        engine.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url")
    p.add_argument("--model")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--max-num-seqs", type=int, help="as `hf2q serve --max-num-seqs` (fewer graphs to capture)")
    p.add_argument("--concurrent", type=int, default=0, help="then time (and profile) this many sequences decoding together")
    p.add_argument("--burst", type=int, default=0,
                   help="first, this many requests arriving at once: the steps to their first tokens (twice)")
    p.add_argument("--history", type=int, default=0,
                   help="then a follow-up turn over this many tokens: a prefix-cache hit against cold "
                        "(--prompt-tokens new ones)")
    a, serve_args = p.parse_known_args()  # the rest are `hf2q serve` flags, e.g. --short-prefill-graphs
    logging.basicConfig(level="INFO", format="%(message)s")  # the engine's sizing and warm-up lines
    if a.url:
        chunk_timeline(a.url.rstrip("/"), a.prompt_tokens, a.max_tokens)
    if a.model:
        engine_steps(a.model, a.prompt_tokens, a.max_tokens, a.requests, a.profile, a.max_num_seqs, a.concurrent,
                     a.history, tuple(serve_args), a.burst)


if __name__ == "__main__":
    main()
