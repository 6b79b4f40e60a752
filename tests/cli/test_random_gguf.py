"""tools/random_gguf.py (the served benchmarks' model files) writes files hf2q loads, dense and MoE, under the
architecture their shape has (a MoE file written as `qwen35` lacked `qwen35.feed_forward_length` at load)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import hf2q

TOOL = Path(__file__).resolve().parents[2] / "tools" / "random_gguf.py"


@pytest.mark.parametrize("kind", ["moe"])
def test_random_gguf_loads_with_its_shapes_architecture(kind, request, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("random_gguf", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cfg = hf2q.load(request.getfixturevalue(f"gguf_{kind}_f32")).config  # a tiny shape of that kind
    monkeypatch.setitem(tool.SHAPES, "tiny", (cfg, False))
    tool.write("tiny", "bf16", tmp_path / "m.gguf", mtp=True)
    model = hf2q.load(tmp_path / "m.gguf")
    assert model.config.arch == cfg.arch and model.config.num_experts == cfg.num_experts
    assert model.net.mtp is not None
