"""`hf2q bench serve`: drive an OpenAI-compatible endpoint with concurrent streaming clients and report
throughput and latency per concurrency level.

The client speaks plain HTTP + SSE, so hf2q, llama-server and vLLM are measured the same way. Token counts
come only from the server's `usage` (requested with `stream_options.include_usage`), never from the number
of chunks: a chunk may carry several tokens, or none. A stream that ends without usage is an error.

Each level of `--clients N` starts N clients at once; each sends `--requests-per-client` requests back to
back, so a level is N x R requests with at most N in flight. Before the first level, `--warm-up-requests`
requests (one by default, a prompt of their own) are sent one after another and not counted, as vLLM's
benchmark sends its test prompt first: the client's own first request pays for its connection and lazy imports
(about 18 ms of its time to first token on a 2-core host), which is not the server's time. Their figures are
reported apart (`warm_up`): the first one's TTFT is a fresh server's first-request TTFT.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx

from hf2q.loadgen_stream import (  # noqa: F401  (re-exported for tests and tools)
    PROMPT_WORDS, RequestResult, parse_sse_line, read_stream, send)

DEFAULT_MAX_TOKENS = 128
WARM_UP_TOKENS = 4  # tokens a warm-up request asks for: a few streamed chunks
WARM_UP_SEED = 1_000_003  # the warm-up prompts' seed offset: words no measured prompt starts with
CHARS_PER_TOKEN = 4  # the dataset reply's length in characters / this = its max_tokens hint


def add_loadgen_args(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running OpenAI-compatible server, e.g. http://127.0.0.1:8080")
    target.add_argument("--model", help="start `hf2q serve --model MODEL` on a free loopback port, measure it, stop it")
    p.add_argument("--serve-args", default="", help="extra `hf2q serve` flags with --model, as one quoted string")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (and given to the server --model starts)")
    p.add_argument("--model-name", help="the request's `model` field (default: the first id of /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="streaming /v1/completions (raw prompt) or /v1/chat/completions (one user message)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64], help="concurrency levels, run in turn")
    p.add_argument("--requests-per-client", type=int, default=1,
                   help="requests each client sends back to back (with --multi-turn: conversations)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length in tokens (without --dataset)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens generated per request, with ignore_eos (default {DEFAULT_MAX_TOKENS}; with "
                        f"--dataset: the reference reply's characters / {CHARS_PER_TOKEN})")
    p.add_argument("--dataset", help="JSON or JSONL conversations (ShareGPT `conversations` or `messages`): "
                                     "the first user turn is the prompt")
    p.add_argument("--multi-turn", type=int, default=0, metavar="TURNS",
                   help="each client plays a chat conversation of TURNS turns, each sent with the server's earlier "
                        "answers appended; reports the prefix cache hit rate and the follow-up turns' TTFT")
    p.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="with --multi-turn: every conversation opens with the same system prompt of this many tokens")
    p.add_argument("--warm-up-requests", type=int, default=1,
                   help="requests sent before the first level and not counted (reported apart; 0: none)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt words")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the started server")
    p.add_argument("--json", help="also write every figure, and each request's usage, to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none either when stderr is no tty)")


@dataclass
class Prompt:
    text: str
    max_tokens: int


def fixed_prompts(count: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt("".join(rng.choice(PROMPT_WORDS) for _ in range(prompt_tokens)), max_tokens)
            for _ in range(count)]


def _first_exchange(record: dict) -> tuple[Optional[str], Optional[str]]:
    """(first user turn, the assistant reply after it) of a ShareGPT or messages record."""
    turns = record.get("conversations") or record.get("messages") or []
    user, reply = None, None
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if not isinstance(text, str):
            continue
        if user is None and role in ("human", "user"):
            user = text
        elif user is not None and role in ("gpt", "assistant", "chatgpt", "bing", "bard"):
            reply = text
            break
    return user, reply


def load_dataset(path: str, max_tokens: Optional[int]) -> list[Prompt]:
    """Prompts from a JSON list or JSONL file of conversations, in file order."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
        records = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        try:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is neither JSON nor JSONL: {exc}") from None
    prompts = []
    for record in records:
        user, reply = _first_exchange(record) if isinstance(record, dict) else (None, None)
        if not user:
            continue
        if max_tokens is not None:
            prompts.append(Prompt(user, max_tokens))
        elif reply:
            prompts.append(Prompt(user, max(1, math.ceil(len(reply) / CHARS_PER_TOKEN))))
    if not prompts:
        raise ValueError(f"{path} has no conversation with a user turn" +
                         ("" if max_tokens is not None else " followed by a reply (or give --max-tokens)"))
    return prompts


# ---------------------------------------------------------------- one streaming request

def request_body(endpoint: str, prompt: Prompt, model: Optional[str], temperature: float) -> dict:
    body: dict = {"max_tokens": prompt.max_tokens, "temperature": temperature, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return body


async def run_level(client: httpx.AsyncClient, path: str, bodies: list[list[dict]], progress) -> tuple[list, float]:
    """bodies[i] are client i's requests, sent back to back; all clients start together."""
    results: list[RequestResult] = []

    async def one_client(mine: list[dict]) -> None:
        for body in mine:
            results.append(await send(client, path, body))
            progress.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(one_client(mine) for mine in bodies))
    return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100), interpolating linearly between order statistics (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(seconds * 1000, 3)


def _spread_ms(values: list[float]) -> dict:
    out = {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
    out["mean"] = sum(values) / len(values) if values else None
    return {k: _ms(v) for k, v in out.items()}


def summarize(clients: int, results: list[RequestResult], wall: float) -> dict:
    """Every figure of one level; output tokens are the sum of the servers' completion_tokens."""
    ok = [r for r in results if r.error is None]
    errors = [r for r in results if r.error is not None]
    output_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "clients": clients, "requests": len(results), "ok": len(ok), "errors": len(errors),
        "first_error": errors[0].error if errors else None, "wall_s": round(wall, 4),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else None,
        "follow_up_ttft_ms": _spread_ms([r.ttft for r in ok if r.turn and r.ttft is not None]),
        "output_tok_s": output_tokens / wall if wall > 0 else None,
        "requests_s": len(ok) / wall if wall > 0 else None,
        "ttft_ms": _spread_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _spread_ms([r.itl for r in ok if r.itl is not None]),
        "chunk_gap_ms": _spread_ms([g for r in ok for g in r.gaps]),
        "latency_ms": _spread_ms([r.latency for r in ok]),
        "per_request": [{"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                         "cached_tokens": r.cached_tokens, "turn": r.turn,
                         "ttft_ms": _ms(r.ttft), "itl_ms": _ms(r.itl), "latency_ms": _ms(r.latency),
                         "text_chunks": r.text_chunks, "error": r.error} for r in results],
    }


def format_table(levels: list[dict]) -> str:
    def f(v, fmt=",.1f"):
        return "-" if v is None else format(v, fmt)

    head = ("| clients | requests | errors | prompt tok/req | cached | out tok/s | req/s | TTFT ms p50 / p90 / p99 "
            "| follow-up TTFT ms p50 | ITL ms p50 / p90 / p99 |")
    rows = [head, "|" + "---|" * 10]
    for lv in levels:
        t, i = lv["ttft_ms"], lv["itl_ms"]
        rows.append(f"| {lv['clients']} | {lv['requests']} | {lv['errors']} | "
                    f"{f(lv['prompt_tokens'] / lv['ok'] if lv['ok'] else None)} | "
                    f"{f(None if lv['hit_rate'] is None else 100 * lv['hit_rate'])}% | {f(lv['output_tok_s'])} | "
                    f"{f(lv['requests_s'], '.2f')} | {f(t['p50'])} / {f(t['p90'])} / {f(t['p99'])} | "
                    f"{f(lv['follow_up_ttft_ms']['p50'])} | "
                    f"{f(i['p50'], '.2f')} / {f(i['p90'], '.2f')} / {f(i['p99'], '.2f')} |")
    return "\n".join(rows)


# ---------------------------------------------------------------- the target server

def base_url(url: str) -> str:
    """`http://host:port`, from a URL that may end in `/` or `/v1`; a clear error for anything else."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"bad --url {url!r}: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"bad --url {url!r}: expected http://host:port")
    path = parsed.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return str(parsed.copy_with(path=path or "/", query=None, fragment=None)).rstrip("/")


def probe(url: str, headers: dict) -> Optional[str]:
    """Check the server answers; return the first model id of /v1/models (None if it lists none)."""
    try:
        response = httpx.get(url + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {exc}") from None
    if response.status_code in (401, 403):
        raise ValueError(f"{url} refused the API key (HTTP {response.status_code}); give --api-key")
    try:
        models = response.json().get("data") or []
        return models[0].get("id") if response.status_code == 200 and models else None
    except (ValueError, AttributeError, IndexError):
        return None


class StartedServer:
    """`hf2q serve` on a free loopback port, for the duration of a run."""

    def __init__(self, model: str, serve_args: str, api_key: Optional[str], timeout: float):
        if not Path(model).is_file():
            raise FileNotFoundError(f"no model file {model}")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "hf2q.cli", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), *shlex.split(serve_args)] + (["--api-key", api_key] if api_key else [])
        self.log = tempfile.TemporaryFile("w+")
        print(f"starting: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(f"hf2q serve exited with {self.proc.returncode}:\n{self._tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ValueError(f"hf2q serve was not healthy after {timeout:.0f} s:\n{self._tail()}")

    def _tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------- the run

def _check_args(args) -> None:
    if min(args.clients) < 1 or args.requests_per_client < 1:
        raise ValueError("--clients and --requests-per-client must be >= 1")
    if args.prompt_tokens < 1 or (args.max_tokens is not None and args.max_tokens < 1):
        raise ValueError("--prompt-tokens and --max-tokens must be >= 1")
    if args.serve_args and not args.model:
        raise ValueError("--serve-args needs --model")
    if args.multi_turn < 0 or args.shared_prefix_tokens < 0:
        raise ValueError("--multi-turn and --shared-prefix-tokens must be >= 0")
    if args.shared_prefix_tokens and not args.multi_turn:
        raise ValueError("--shared-prefix-tokens needs --multi-turn")
    if args.warm_up_requests < 0:
        raise ValueError("--warm-up-requests must be >= 0")
    if args.multi_turn and (args.dataset or args.endpoint != "chat"):
        raise ValueError("--multi-turn needs --endpoint chat and no --dataset")


async def warm_up(client: httpx.AsyncClient, path: str, args, model_name: Optional[str],
                  measured: Prompt) -> Optional[dict]:
    """Send the --warm-up-requests, one after another (None when there are none): their count, the first one's
    TTFT and latency, and the first error. Their prompts are random words, as many as the first measured prompt
    has (never its text: the measured request would find it in the prefix cache)."""
    words = len(measured.text.split()) if args.dataset else args.prompt_tokens
    prompts = fixed_prompts(args.warm_up_requests, max(words, 1), WARM_UP_TOKENS, args.seed + WARM_UP_SEED)
    results = [await send(client, path, request_body(args.endpoint, p, model_name, args.temperature)) for p in prompts]
    if not results:
        return None
    errors = [r.error for r in results if r.error is not None]
    return {"requests": len(results), "errors": len(errors), "first_error": errors[0] if errors else None,
            "ttft_ms": _ms(results[0].ttft), "latency_ms": _ms(results[0].latency)}


async def measure(args, url: str, model_name: Optional[str],
                  prompts: list[Prompt]) -> tuple[Optional[dict], list[dict]]:
    """The warm-up's figures (None without one) and each level's."""
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    total = sum(args.clients) * (args.multi_turn or 1) * args.requests_per_client
    from tqdm import tqdm

    show = not args.no_progress and sys.stderr.isatty()
    levels, used = [], 0
    limits = httpx.Limits(max_connections=max(args.clients), max_keepalive_connections=max(args.clients))
    timeout = httpx.Timeout(args.timeout, connect=30)
    with tqdm(total=total, unit="req", file=sys.stderr, disable=not show) as progress:
        async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as client:
            progress.set_description("warm-up")
            warm = await warm_up(client, path, args, model_name, prompts[0] if prompts else Prompt("", 1))
            for n in args.clients:
                progress.set_description(f"{n} clients")
                if args.multi_turn:
                    results, wall = await _conversations(client, args, model_name, n, progress)
                    levels.append(summarize(n, results, wall))
                    continue
                bodies = []
                for _ in range(n):
                    mine = [prompts[(used + k) % len(prompts)] for k in range(args.requests_per_client)]
                    used += args.requests_per_client
                    bodies.append([request_body(args.endpoint, p, model_name, args.temperature) for p in mine])
                results, wall = await run_level(client, path, bodies, progress)
                levels.append(summarize(n, results, wall))
    return warm, levels


async def _conversations(client: httpx.AsyncClient, args, model_name: Optional[str], n: int,
                         progress) -> tuple[list, float]:
    from hf2q.loadgen_conversations import play, questions, shared_prefix

    system = shared_prefix(args.shared_prefix_tokens, args.seed) if args.shared_prefix_tokens else None
    body = {k: v for k, v in request_body("chat", Prompt("", args.max_tokens or DEFAULT_MAX_TOKENS), model_name,
                                          args.temperature).items() if k != "messages"}
    each = args.requests_per_client

    async def conversations(c: int) -> list:
        """Client c's conversations, one after another, each with questions of its own."""
        done = []
        for k in range(each):
            done += await play(client, questions(c * each + k, args.multi_turn, args.prompt_tokens, args.seed),
                               system, body, progress)
        return done

    start = time.perf_counter()
    played = await asyncio.gather(*(conversations(c) for c in range(n)))
    return [r for conversation in played for r in conversation], time.perf_counter() - start


def run_loadgen(args) -> int:
    """Measure each concurrency level; exit 1 when any request failed (the figures are printed anyway)."""
    _check_args(args)
    if args.dataset:
        prompts = load_dataset(args.dataset, args.max_tokens)
    else:
        count = sum(args.clients) * args.requests_per_client
        prompts = fixed_prompts(count, args.prompt_tokens, args.max_tokens or DEFAULT_MAX_TOKENS, args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server = StartedServer(args.model, args.serve_args, args.api_key, args.startup_timeout) if args.model else None
    try:
        url = server.url if server else base_url(args.url)
        model_name = args.model_name or probe(url, headers)
        warm, levels = asyncio.run(measure(args, url, model_name, prompts))
    finally:
        if server:
            server.stop()
    report = {"url": url, "endpoint": args.endpoint, "model": model_name, "dataset": args.dataset,
              "prompt_tokens_asked": None if args.dataset else args.prompt_tokens, "max_tokens": args.max_tokens,
              "requests_per_client": args.requests_per_client, "warm_up": warm, "levels": levels}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if warm is not None:
        print(f"warm-up (not counted): {warm['requests']} request(s), the first's TTFT "
              f"{'-' if warm['ttft_ms'] is None else format(warm['ttft_ms'], ',.1f')} ms")
    print(format_table(levels))
    counted = {r["prompt_tokens"] for lv in levels for r in lv["per_request"] if r["error"] is None}
    if not args.dataset and args.endpoint == "completions" and counted and counted != {args.prompt_tokens}:
        print(f"note: the server counted {sorted(counted)} prompt tokens for --prompt-tokens {args.prompt_tokens}",
              file=sys.stderr)
    for lv in levels:
        if lv["errors"]:
            print(f"{lv['clients']} clients: {lv['errors']} failed; first: {lv['first_error']}", file=sys.stderr)
    if warm is not None and warm["errors"]:
        print(f"warm-up: {warm['errors']} failed; first: {warm['first_error']}", file=sys.stderr)
    return 1 if any(lv["errors"] for lv in levels) or (warm is not None and warm["errors"]) else 0

