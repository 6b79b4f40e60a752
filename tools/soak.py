"""Soak: N streaming clients for a fixed time against `hf2q serve`, with the server's RSS (and, where nvidia-smi
runs, its GPU memory) sampled throughout.

Answers what a benchmark of a few hundred requests cannot: whether every admitted request still completes
after thousands, whether rejections are 429s and nothing else, whether the server's memory stays flat and
whether inter-token latency drifts. Each client sends requests back to back until the deadline; a request
already sent then finishes, so the run stops by itself about one request after --duration.

    python tools/soak.py --clients 64 --duration 600 --json soak.json       # starts the demo model itself
    python tools/soak.py --url http://127.0.0.1:8080 --pid 1234 ...          # a server already running

Loopback only: the started server listens on 127.0.0.1, and --url must name a loopback host.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from typing import Optional

import httpx

from hf2q.loadgen import StartedServer, base_url, fixed_prompts, percentile, probe, request_body, send


def rss_kib(pid: int) -> int:
    """The process's resident set (VmRSS) in KiB, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise ValueError(f"no VmRSS for pid {pid}")


def gpu_mib(pid: int) -> Optional[int]:
    """The process's GPU memory in MiB as nvidia-smi reports it (all devices), or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    rows = [[field.strip() for field in line.split(",")] for line in out.splitlines()]
    return sum(int(mib) for p, mib in (r for r in rows if len(r) == 2) if p == str(pid) and mib.isdigit())


def gauges(url: str) -> dict:
    """Running and waiting request gauges (both should read 0 once the load stops) and the bytes held by
    retained prefixes (which legitimately grow RSS up to --prefix-cache-gb), from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        for name in ("hf2q_num_requests_running", "hf2q_num_requests_waiting", "hf2q_prefix_cache_bytes"):
            if line.startswith(name + " "):
                out[name] = float(line.split()[1])
    return out


def _ms(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v * 1000, 3)


def rejected(result) -> bool:
    """Whether a request was turned away with a 429 (the server full), which a soak counts apart from errors."""
    return bool(result.error) and result.error.startswith("HTTP 429")


def summarize_minutes(done: list[tuple[float, object]], bucket_s: float) -> list[dict]:
    """Per bucket of finish time: requests completed, errors, 429s, p50/p99 ITL and p99 chunk gap (ms)."""
    buckets: dict[int, list] = {}
    for t, r in done:
        buckets.setdefault(int(t // bucket_s), []).append(r)
    rows = []
    for k in sorted(buckets):
        rs = buckets[k]
        ok = [r for r in rs if r.error is None]
        itl = [r.itl for r in ok if r.itl is not None]
        gaps = [g for r in ok for g in r.gaps]
        rows.append({"minute": k + 1, "completed": len(ok), "errors": len(rs) - len(ok),
                     "rejected_429": sum(1 for r in rs if rejected(r)),
                     "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
                     "gap_p99_ms": _ms(percentile(gaps, 99))})
    return rows


def progress_line(t: float, done: list[tuple[float, object]], kib: int, mib: Optional[int]) -> str:
    """So far: requests completed, errors, 429s, RSS, GPU memory, p99 inter-token latency of the whole run."""
    ok = [r for _, r in done if r.error is None]
    itl = [r.itl for r in ok if r.itl is not None]
    turned_away = sum(1 for _, r in done if rejected(r))
    return (f"soak {t:.0f} s: {len(ok)} completed, {len(done) - len(ok) - turned_away} errors, "
            f"{turned_away} rejected (429), RSS {kib / 1024:.0f} MiB" + ("" if mib is None else f", GPU {mib} MiB")
            + f", ITL p99 {_ms(percentile(itl, 99))} ms")


async def soak(url: str, pid: int, clients: int, duration: float, prompt_tokens: int, max_tokens: int,
               sample_s: float = 10.0, bucket_s: float = 60.0, seed: int = 0) -> dict:
    """Drive `clients` streaming clients until `duration` seconds have passed; sample RSS every sample_s."""
    model = probe(url, {})
    rng = random.Random(seed)
    done: list[tuple[float, object]] = []
    rss: list[tuple[float, int]] = [(0.0, rss_kib(pid))]
    gpu: list[tuple[float, Optional[int]]] = [(0.0, gpu_mib(pid))]
    start = time.monotonic()
    deadline = start + duration

    async def client(c: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            prompt = fixed_prompts(1, prompt_tokens, max_tokens, rng.randrange(1 << 30))[0]
            result = await send(c, "/v1/completions", request_body("completions", prompt, model, 0.0))
            done.append((time.monotonic() - start, result))

    async def sampler() -> None:
        report_at = bucket_s
        while time.monotonic() < deadline:
            await asyncio.sleep(min(sample_s, max(0.0, deadline - time.monotonic())))
            rss.append((time.monotonic() - start, rss_kib(pid)))
            gpu.append((time.monotonic() - start, gpu_mib(pid)))
            if rss[-1][0] >= report_at:  # a line a bucket as it goes: a run cut short still tells its figures
                report_at += bucket_s
                print(progress_line(rss[-1][0], done, rss[-1][1], gpu[-1][1]), file=sys.stderr, flush=True)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(300, connect=30)) as c:
        await asyncio.gather(sampler(), *(client(c) for _ in range(clients)))
    wall = time.monotonic() - start
    await asyncio.sleep(1.0)  # let the engine retire the last requests before reading the gauges
    rss.append((time.monotonic() - start, rss_kib(pid)))
    gpu.append((time.monotonic() - start, gpu_mib(pid)))
    errors = [r for _, r in done if r.error is not None]
    turned_away = [r for r in errors if rejected(r)]
    values = [v for _, v in rss]
    return {
        "url": url, "pid": pid, "clients": clients, "duration_s": duration, "wall_s": round(wall, 1),
        "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
        "requests": len(done), "completed": len(done) - len(errors), "rejected_429": len(turned_away),
        "other_errors": len(errors) - len(turned_away),
        "first_other_error": next((r.error for r in errors if not rejected(r)), None),
        "short_completions": sum(1 for _, r in done if r.error is None and r.completion_tokens != max_tokens),
        "rss_kib": {"start": values[0], "min": min(values), "max": max(values), "end": values[-1]},
        "rss_samples": [{"t_s": round(t, 1), "kib": v} for t, v in rss],
        "gpu_mib_samples": [{"t_s": round(t, 1), "mib": v} for t, v in gpu if v is not None],
        "health": httpx.get(url + "/health", timeout=10).status_code,
        "gauges_after": gauges(url),
        "minutes": summarize_minutes(done, bucket_s),
    }


def format_report(r: dict) -> str:
    m = r["rss_kib"]
    lines = [f"{r['requests']} requests in {r['wall_s']} s with {r['clients']} clients: {r['completed']} completed, "
             f"{r['rejected_429']} rejected (429), {r['other_errors']} other errors, "
             f"{r['short_completions']} completions short of {r['max_tokens']} tokens",
             f"RSS MiB start {m['start'] / 1024:.1f}, min {m['min'] / 1024:.1f}, max {m['max'] / 1024:.1f}, "
             f"end {m['end'] / 1024:.1f}; /health {r['health']}; gauges after {r['gauges_after']}",
             *([f"GPU MiB start {g[0]['mib']}, min {min(x['mib'] for x in g)}, max {max(x['mib'] for x in g)}, "
                f"end {g[-1]['mib']}"] if (g := r.get("gpu_mib_samples")) else []),
             "| minute | completed | errors | 429 | ITL p50 ms | ITL p99 ms | chunk gap p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for row in r["minutes"]:
        lines.append(f"| {row['minute']} | {row['completed']} | {row['errors']} | {row['rejected_429']} | "
                     f"{row['itl_p50_ms']} | {row['itl_p99_ms']} | {row['gap_p99_ms']} |")
    if r["first_other_error"]:
        lines.append(f"first other error: {r['first_other_error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server on loopback (with --pid); default: start the demo model")
    p.add_argument("--pid", type=int, help="the --url server's process id, for its RSS")
    p.add_argument("--serve-args", default="--max-num-seqs 64", help="flags for the started server")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=600.0, help="seconds to keep sending requests")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--json", help="write every figure to this file")
    args = p.parse_args(argv)
    if (args.url is None) != (args.pid is None):
        p.error("--url and --pid go together")
    server = None
    if args.url:
        url = base_url(args.url)
        if httpx.URL(url).host not in ("127.0.0.1", "localhost", "::1"):
            p.error("--url must be a loopback address")
        pid = args.pid
    else:
        from hf2q.demo import demo_model_path

        server = StartedServer(str(demo_model_path()), args.serve_args, None, 600)
        url, pid = server.url, server.proc.pid
    try:
        report = asyncio.run(soak(url, pid, args.clients, args.duration, args.prompt_tokens, args.max_tokens,
                                  args.sample_s))
    finally:
        if server:
            server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(format_report(report))
    return 1 if report["other_errors"] or report["health"] != 200 else 0


if __name__ == "__main__":
    sys.exit(main())
