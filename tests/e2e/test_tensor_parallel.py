"""`hf2q serve --tensor-parallel-size 2` on CPU (gloo): same greedy chat replies as one rank, and no rank
outlives the server, whether it is stopped by SIGTERM or killed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf2q.distributed.serve import check_tensor_parallel
from tests.e2e.conftest import free_port
from tests.e2e.conftest import PLAIN_FLAGS, Server

TP_FLAGS = (*PLAIN_FLAGS, "--tensor-parallel-size", "2")
PROMPTS = ["Hello there", "Write one word about the sea.", "1, 2, 3,"]


def children(pid: int) -> list[int]:
    """Live child processes of `pid`, from /proc."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def greedy_replies(server: Server) -> list[tuple[str | None, str | None]]:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = []
    for prompt in PROMPTS:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=8, temperature=0)
        assert r.usage.completion_tokens > 0
        msg = r.choices[0].message
        out.append((msg.content, getattr(msg, "reasoning_content", None)))
    return out


@pytest.fixture
def tp_server(served_model_path, tmp_path):
    server = Server(served_model_path, list(TP_FLAGS), tmp_path / "server.log")
    yield server
    server.stop()


def test_tp2_greedy_chat_matches_one_rank_and_sigterm_ends_every_rank(server_factory, tp_server):
    plain = server_factory(*PLAIN_FLAGS)
    workers = [p for p in children(tp_server.proc.pid) if "resource_tracker" not in _cmdline(p)]
    assert len(workers) == 1, "rank 0 should have spawned one worker rank"
    assert greedy_replies(tp_server) == greedy_replies(plain)
    tp_server.proc.send_signal(signal.SIGTERM)
    # uvicorn re-raises the signal it caught once its graceful shutdown (which reaps the workers) is done
    assert tp_server.proc.wait(timeout=30) in (0, -signal.SIGTERM), tp_server.log()
    assert "terminating it" not in tp_server.log(), "the worker had to be terminated, not released"
    assert wait_gone(workers, 10) == [], "a worker rank outlived the server"


def test_killed_rank0_leaves_no_worker(served_model_path, tmp_path):
    # workers are spawned before rank 0 loads; kill rank 0 as soon as one exists, with no shutdown at all
    cmd = [sys.executable, "-m", "hf2q.cli", "serve", "--model", str(served_model_path), "--device", "cpu",
           "--port", str(free_port()), *TP_FLAGS]
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (workers := [p for p in children(proc.pid) if "spawn_main" in _cmdline(p)]):
            assert proc.poll() is None and time.monotonic() < deadline, "no worker rank was spawned"
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(workers, 15) == [], "an orphaned worker rank kept running"


@pytest.mark.slow
def test_dead_worker_stops_the_server(tp_server):
    """A dead rank fails every step: the server must stop, not stay 'healthy' and answer only errors."""
    kids = children(tp_server.proc.pid)
    workers = [p for p in kids if "spawn_main" in _cmdline(p)]
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)
    assert tp_server.proc.wait(timeout=30) != 0
    assert "tensor-parallel rank 1 exited" in tp_server.log()
    assert "Traceback" not in tp_server.log(), tp_server.log()
    assert wait_gone(kids, 5) == []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def test_head_counts_that_do_not_split_are_a_clean_startup_error(served_model_path):
    cmd = [sys.executable, "-m", "hf2q.cli", "serve", "--model", str(served_model_path), "--device", "cpu",
           "--tensor-parallel-size", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 1
    assert "error: tensor parallel size 3" in done.stderr and "divisible by 3" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_cuda_needs_one_gpu_per_rank(served_model_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 GPUs, but 1 are visible"):
        check_tensor_parallel(served_model_path, 2, torch.device("cuda"))
    with pytest.raises(ValueError, match="use --device cuda"):
        check_tensor_parallel(served_model_path, 2, torch.device("cuda", 1))
    check_tensor_parallel(served_model_path, 2, torch.device("cpu"))
