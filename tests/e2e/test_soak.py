"""A few seconds of the soak in tools/soak.py, so CI runs the same driver as the 10-minute run in BENCHMARKS.md.

16 streaming clients send requests back to back against the shared load-test server (8 slots, 16 queued):
every request completes in full or is a 429, the server stays healthy, its request gauges return to 0, and
its resident memory after the run is within RSS_BOUND_KIB of before (after a warm-up, so that first-use
allocations are not counted as growth).
"""
from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from tests.e2e.test_load import LOAD_FLAGS

CLIENTS = 16
MAX_TOKENS = 8
RSS_BOUND_KIB = 64 * 1024  # 64 MiB: allocator slack; a leak per request would exceed it over hundreds


def load_soak():
    """tools/ is no package: load the module from its file."""
    path = Path(__file__).resolve().parents[2] / "tools" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def load_server(server_factory):
    return server_factory(*LOAD_FLAGS)


def test_short_soak(load_server, capsys):
    soak = load_soak()
    pid = load_server.proc.pid
    asyncio.run(soak.soak(load_server.url, pid, CLIENTS, 2.0, 8, MAX_TOKENS))  # warm-up
    capsys.readouterr()
    report = asyncio.run(soak.soak(load_server.url, pid, CLIENTS, 6.0, 8, MAX_TOKENS, sample_s=2.0, bucket_s=2.0))
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("soak ")]
    assert 2 <= len(progress) <= 3, progress  # a line a bucket while it runs
    counts = [int(line.split(": ")[1].split(" completed")[0]) for line in progress]
    assert counts == sorted(counts) and 0 < counts[-1] <= report["completed"], (progress, report["completed"])
    assert all(", 0 errors," in line for line in progress), progress

    assert report["other_errors"] == 0, report["first_other_error"]
    assert report["completed"] > CLIENTS, report
    assert report["completed"] + report["rejected_429"] == report["requests"]
    assert report["short_completions"] == 0
    assert report["health"] == 200 and load_server.healthy()
    assert report["gauges_after"]["hf2q_num_requests_running"] == 0
    assert report["gauges_after"]["hf2q_num_requests_waiting"] == 0
    rss = report["rss_kib"]
    assert rss["end"] <= rss["start"] + RSS_BOUND_KIB, report["rss_samples"]
