"""A real `hf2q serve` process on a loopback port, talked to over HTTP.

Servers are session-scoped and keyed by their flags, so test modules that want the same server share
one process (loading takes a while on a CPU). The model is the tiny fixture GGUF `gguf_dense_f32`
when the suite provides it, else the built-in demo model (same architecture and vocabulary).
"""
from __future__ import annotations

import json
import os
import socket
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, extra: list[str], log_path: Path):
        self.log_path = log_path
        for attempt in range(3):
            # The port is free when chosen but not held until the server binds it after loading; another
            # process (a tensor-parallel group's own sockets among them) can take it first. Then: a new port.
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [sys.executable, "-m", "hf2q.cli", "serve", "--model", str(model), "--port", str(self.port),
                   "--log-level", "warning", *extra]
            self._log = open(log_path, "w")
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            # Ctrl-C as a terminal delivers it: a suite run as a background job starts with SIGINT ignored,
            # which the server would inherit (its exit code after SIGINT is then 0, not 130).
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            try:
                self._wait_ready()
                return
            except RuntimeError:
                if attempt == 2 or "address already in use" not in self.log():
                    raise
                self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hf2q serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"hf2q serve did not become healthy in {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def healthy(self) -> bool:
        return self.proc.poll() is None and httpx.get(self.url + "/health", timeout=5).status_code == 200

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def served_model_path(request) -> Path:
    try:
        return Path(request.getfixturevalue("gguf_dense_f32"))
    except (pytest.FixtureLookupError, pytest.skip.Exception):
        from hf2q.demo import demo_model_path

        return demo_model_path()


@pytest.fixture(scope="session")
def server_factory(served_model_path, tmp_path_factory):
    """start(flags...) -> Server, one process per distinct flag list for the whole session."""
    servers: dict[tuple, Server] = {}

    def start(*flags: str, scripted: list[str] | None = None) -> Server:
        key = (flags, json.dumps(scripted))
        if key not in servers:
            d = tmp_path_factory.mktemp("server")
            extra = list(flags)
            if scripted is not None:
                (d / "replies.json").write_text(json.dumps(scripted))
                extra += ["--scripted-replies", str(d / "replies.json")]
            servers[key] = Server(served_model_path, extra, d / "server.log")
        return servers[key]

    yield start
    for server in servers.values():
        server.stop()


# The plain (sampling) server that most modules share.
PLAIN_FLAGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--served-model-name", "tiny")


@pytest.fixture(scope="session")
def plain_server(server_factory) -> Server:
    return server_factory(*PLAIN_FLAGS)


@pytest.fixture(scope="session")
def client(plain_server):
    import openai

    return openai.OpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
