"""`hf2q bench vision` runs the tower on random weights and prints the time per image (tiny tower, CPU)."""
from __future__ import annotations

import re

import hf2q.bench.vision as bench_vision
from hf2q.cli import main


def test_bench_vision_prints_time_per_image(monkeypatch, capsys):
    monkeypatch.setattr(bench_vision, "_TOWER", dict(bench_vision._TOWER, hidden_size=64, intermediate_size=96,
                                                     depth=2, num_heads=2))
    args = ["bench", "vision", "--device", "cpu", "--dtype", "fp32", "--image", "64", "--images", "1", "2",
            "--repeat", "1"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r"[\d.]+ ms", "T ms", line) for line in lines] == [
        "vision 9b 64x64 images=1: T ms per call, T ms per image, 4 soft tokens per image (fp32)",
        "vision 9b 64x64 images=2: T ms per call, T ms per image, 4 soft tokens per image (fp32)"]


def test_bench_vision_refuses_odd_sizes(capsys):
    assert main(["bench", "vision", "--device", "cpu", "--image", "100"]) == 1
    assert "--image must be a multiple of 32" in capsys.readouterr().err
