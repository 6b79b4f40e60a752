"""The `hf2q serve` process's start and stop: it takes its port before loading (a port in use is a clean error
at once, not after the model has loaded), answers /health only once warmed up with nothing left for a first request
to import, profiles its steps on request (--profile-dir), and on Ctrl-C ends the running streams cleanly. The tests
from the warm-up's on share one server, which the Ctrl-C test stops."""
from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, free_port


def test_port_in_use_fails_before_loading(served_model_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "hf2q.cli", "serve", "--model", str(served_model_path), "--port", str(port)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 1, done.stderr
    assert f"error: port {port} on 127.0.0.1 is in use" in done.stderr, done.stderr
    assert "loading" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_flag_the_device_cannot_honour_is_a_clean_startup_error(served_model_path):
    """A flag the server cannot honour here is refused by name before loading, never silently dropped."""
    cmd = [sys.executable, "-m", "hf2q.cli", "serve", "--model", str(served_model_path), "--port", str(free_port()),
           "--device", "cpu", "--short-prefill-graphs"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 1, done.stderr
    assert "--short-prefill-graphs needs a CUDA device" in done.stderr, done.stderr
    assert "loading" not in done.stderr and "Traceback" not in done.stderr, done.stderr


# Builds the server's state as `hf2q serve` does (load, warm-up, settle), answers /health once, then streams one
# completion and one chat reply through the app, printing the modules those first requests imported.
FIRST_REQUESTS = """
import asyncio, json, sys
import httpx
from hf2q.server import launch
from hf2q.server.app import build_app
parser = launch.argparse.ArgumentParser()
launch.add_serve_args(parser)
state = launch.build_state(parser.parse_args(["--model", sys.argv[1], "--log-level", "warning"]))
app = build_app(state)

async def first_requests():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hf2q") as client:
        assert (await client.get("/health")).status_code == 200
        before = set(sys.modules)
        for path, body in (("/v1/completions", {"prompt": "hello"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            body = {**body, "model": state.config.model_name, "max_tokens": 2, "stream": True}
            async with client.stream("POST", path, json=body) as response:
                assert response.status_code == 200
                assert [line async for line in response.aiter_lines()][-2:] == ["data: [DONE]", ""]
        return sorted(set(sys.modules) - before)

print(json.dumps(asyncio.run(first_requests())))
state.engine.shutdown()
"""


def test_first_streamed_requests_import_nothing(served_model_path):
    """Whatever a first request would import on its way (anyio's asyncio backend, which a streamed response's task
    group loads on first use: 12-14 ms of a first time to first token on a 2-core host) is imported before /health
    says 200."""
    done = subprocess.run([sys.executable, "-c", FIRST_REQUESTS, str(served_model_path)], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], done.stdout


@pytest.fixture(scope="module")
def own_server(served_model_path, tmp_path_factory):
    own = tmp_path_factory.mktemp("own")
    server = Server(served_model_path, ["--log-level", "info", "--profile-dir", str(own / "profiles")],
                    own / "serve.log")
    yield server  # returns at the first /health 200
    server.stop()


def test_health_only_after_warm_up(own_server):
    """/health answers 200 only once the warm-up (prefill compile, decode graphs) has finished: the first
    request never waits for it."""
    text = own_server.log_path.read_text()  # as it was when /health first said 200
    assert "warming up" in text and "warmed up in" in text, text
    assert text.index("warmed up in") < text.index("serving "), text
    # what the start left alive is out of the garbage collector's scans (a full one stalled a first request)
    frozen = text.index("objects out of the garbage collector's scans")
    assert text.index("warmed up in") < frozen < text.index("serving "), text


def test_serves_on_uvloop(own_server):
    """The event loop is uvloop's (a dependency, which uvicorn picks by itself): asyncio's own loop costs a
    streamed token about a third more GIL time (BENCHMARKS.md)."""
    assert "event loop: uvloop" in own_server.log_path.read_text()


def test_profile_records_the_served_steps(own_server, plain_server):
    """--profile-dir: POST /start_profile, requests, POST /stop_profile write torch's profile of the engine steps in
    between (each marked hf2q.step) as a Chrome trace and a table; a second start or stop is a 409; without the flag
    there are no such routes."""
    url = own_server.url
    assert httpx.post(url + "/start_profile", timeout=30).json() == {"status": "profiling"}
    again = httpx.post(url + "/start_profile", timeout=30)
    assert again.status_code == 409 and "already running" in again.json()["error"]["message"]
    body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 4
    stopped = httpx.post(url + "/stop_profile", timeout=60).json()
    assert stopped["status"] == "stopped" and stopped["steps"] >= 4, stopped
    with gzip.open(stopped["trace"], "rt") as f:
        events = json.load(f)["traceEvents"]
    assert sum(e.get("name") == "hf2q.step" for e in events) == stopped["steps"]
    assert Path(stopped["table"]).read_text().startswith(f"{stopped['steps']} engine steps in ")
    assert httpx.post(url + "/stop_profile", timeout=30).status_code == 409
    assert httpx.post(plain_server.url + "/start_profile", timeout=30).status_code == 404


def test_ctrl_c_ends_a_running_stream_cleanly(own_server):
    """Ctrl-C (SIGINT, no --shutdown-timeout): the running stream ends with an error event and [DONE] instead of
    a dropped connection, and the process exits 130 within seconds, without a traceback."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", own_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        t0 = time.monotonic()
        own_server.proc.send_signal(signal.SIGINT)
        rest = [line for line in lines if line]
    code = own_server.proc.wait(timeout=15)
    stopped = time.monotonic() - t0
    log = own_server.log_path.read_text(errors="replace")
    assert code == 130 and stopped < 5 and "Traceback" not in log, (code, stopped, log[-3000:])
    assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2], rest[-3:]
