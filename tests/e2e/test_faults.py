"""Faults through a real server: a storm of clients that leave mid-stream, and SIGTERM with streams running
(--shutdown-timeout)."""
from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import PLAIN_FLAGS, Server

HI = [{"role": "user", "content": "hi"}]
LONG = {"messages": HI, "max_tokens": 400, "ignore_eos": True, "stream": True}


def gauges(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {g: float(re.search(rf"^{g} (\S+)$", text, re.M).group(1))
            for g in ("hf2q_num_requests_running", "hf2q_num_requests_waiting")}


async def leave_after_first_chunk(client: httpx.AsyncClient) -> int:
    async with client.stream("POST", "/v1/chat/completions", json=LONG) as r:
        if r.status_code == 200:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        return r.status_code


@pytest.mark.parametrize("flags", [PLAIN_FLAGS, (*PLAIN_FLAGS, "--async-scheduling")],
                         ids=["plain", "async-scheduling"])
def test_disconnect_storm(server_factory, flags):
    """50 streams that leave after their first chunk: every one aborted (with async scheduling, also while
    a decode step holding it is queued), the gauges back to 0."""
    server = server_factory(*flags)

    async def storm() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=50)) as client:
            return await asyncio.gather(*(leave_after_first_chunk(client) for _ in range(50)))

    statuses = asyncio.run(storm())
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 4, statuses
    deadline = time.monotonic() + 10
    while any(gauges(server).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gauges(server) == {"hf2q_num_requests_running": 0, "hf2q_num_requests_waiting": 0}
    assert server.healthy()


GRACE_S = 1.5


def refuses_new_connections(server, within_s: float) -> bool:
    """Whether the server stops taking connections within `within_s` seconds (it stops listening first): a
    connection is refused, or (uvloop's listener, closing) reset before any answer."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            httpx.get(server.url + "/health", timeout=0.5)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            return True
        time.sleep(0.05)
    return False


def test_sigterm_with_streams_running(served_model_path, tmp_path):
    """--shutdown-timeout: after SIGTERM the server takes no new connections, a short stream finishes normally,
    long ones are ended with an error event and [DONE] once the grace is over; exit 0, no traceback."""
    server = Server(served_model_path, [*PLAIN_FLAGS, "--log-level", "info", "--shutdown-timeout", str(GRACE_S)],
                    tmp_path / "server.log")
    tails: dict[int, list[str]] = {}
    ended: dict[int, float] = {}
    started = threading.Barrier(5)

    def stream(n: int, max_tokens: int) -> None:
        lines = tails.setdefault(n, [])
        try:
            with httpx.stream("POST", server.url + "/v1/chat/completions", json={**LONG, "max_tokens": max_tokens},
                              timeout=60) as r:
                for i, line in enumerate(r.iter_lines()):
                    if line:
                        lines.append(line)
                    if i == 1:
                        started.wait(30)
        except httpx.HTTPError as exc:
            lines.append(f"transport error: {exc!r}")
        ended[n] = time.monotonic()

    try:
        clients = [threading.Thread(target=stream, args=(n, 8 if n == 0 else 480)) for n in range(4)]
        for c in clients:
            c.start()
        started.wait(60)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        refused = refuses_new_connections(server, within_s=GRACE_S / 2)
        code = server.proc.wait(timeout=GRACE_S + 15)
        stopped = time.monotonic() - t0
        for c in clients:
            c.join(10)
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert code == 0 and stopped < GRACE_S + 5, (code, stopped, log[-3000:])
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log[-3000:]
    assert refused  # while the running streams had their grace
    short = tails.pop(0)
    assert short[-1] == "data: [DONE]" and '"finish_reason":"length"' in short[-2].replace(" ", ""), short[-3:]
    for n, lines in tails.items():
        assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2], lines[-3:]
        assert ended[n] - t0 >= GRACE_S - 0.5  # they ran on through the grace
