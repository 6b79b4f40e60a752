"""`hf2q serve` takes its port before loading: a port in use is a clean error at once, not after the
model has loaded."""
from __future__ import annotations

import os
import socket
import subprocess
import sys


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



def test_health_only_after_warm_up(served_model_path, tmp_path):
    """/health answers 200 only once the warm-up (prefill compile, decode graphs) has finished: the first
    request never waits for it."""
    from tests.e2e.conftest import Server

    log_path = tmp_path / "serve.log"
    server = Server(served_model_path, ["--log-level", "info"], log_path)  # returns at the first /health 200
    try:
        text = log_path.read_text()  # as it was when /health first said 200
        assert "warming up" in text and "warmed up in" in text, text
        assert text.index("warmed up in") < text.index("serving "), text
    finally:
        server.stop()
