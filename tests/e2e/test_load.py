"""Load on loopback: 64 streaming clients against one real server, in bounded rounds, with async scheduling
(decode steps queued ahead of the host's reading; the engine tests show its tokens equal plain stepping's).

Every admitted request streams its full output, requests past the queue limit get a clean 429 in the
OpenAI envelope, the server stays healthy, and its resident memory does not grow across rounds.
"""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

CLIENTS = 64
ROUNDS = 3
MAX_TOKENS = 6
LOAD_FLAGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--max-waiting", "16",
              "--max-num-batched-tokens", "256", "--served-model-name", "tiny", "--async-scheduling")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def one_client(client, i: int) -> tuple[str, int]:
    import openai

    try:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"client {i} says hello"}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True})
        finish, tokens = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        assert finish in ("stop", "length"), finish
        assert tokens == MAX_TOKENS or finish == "stop"
        return "ok", tokens
    except openai.RateLimitError as exc:
        assert exc.status_code == 429
        body = exc.response.json()
        assert body["error"]["type"] and body["error"]["message"]
        return "429", 0


async def one_round(url: str) -> list[tuple[str, int]]:
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
        return await asyncio.wait_for(asyncio.gather(*(one_client(client, i) for i in range(CLIENTS))), 600)


@pytest.mark.slow
def test_64_streaming_clients(server_factory):
    server = server_factory(*LOAD_FLAGS)
    memory, rejected = [], 0
    for _ in range(ROUNDS):
        results = asyncio.run(one_round(server.url))
        kinds = [k for k, _ in results]
        assert kinds.count("ok") >= 8 + 16 - 8  # at least what fits running + waiting at once, roughly
        assert kinds.count("ok") + kinds.count("429") == CLIENTS
        assert server.healthy()
        rejected += kinds.count("429")
        memory.append(rss_kib(server.proc.pid))
    assert rejected > 0, "the queue limit was never reached: the test did not exercise rejection"
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    queued = re.search(r"^hf2q_decode_steps_queued_ahead_total (\S+)$", metrics, re.M)
    assert queued and float(queued.group(1)) > 0, "no decode step was queued ahead: async scheduling never ran"
    # After the first round has warmed every allocation, later rounds must not grow memory.
    assert memory[-1] - memory[0] < 64 * 1024, memory
