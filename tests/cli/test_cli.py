"""`hf2q info` and `hf2q generate` on a real fixture file."""
from __future__ import annotations

import json
import subprocess
import sys

import hf2q
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.sampling_params import SamplingParams


def cli(*args):
    proc = subprocess.run([sys.executable, "-m", "hf2q.cli", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_info_describes_the_file(gguf_moe_f32):
    out = cli("info", str(gguf_moe_f32))
    assert "architecture:    qwen35moe" in out
    assert "4 (1 full attention, 3 Gated DeltaNet) + 1 MTP" in out
    assert "LLLA" in out and "MoE 8 experts, top-2" in out
    assert "vocab:           248320" in out and "248046" in out


def test_generate_json_is_the_engine_greedy_path(gguf_dense_f32):
    out = json.loads(cli("generate", "--model", str(gguf_dense_f32), "--prompt-tokens", "9707,11,1879",
                         "--max-tokens", "8", "--ignore-eos", "--json"))
    model = hf2q.load(gguf_dense_f32)
    expected = [t for o in Engine(model, EngineConfig(max_model_len=64)).generate(
        [9707, 11, 1879], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for t in o.new_token_ids]
    assert out["prompt_tokens"] == [9707, 11, 1879]
    assert out["tokens"] == expected
    assert out["text"] == model.tokenizer.decode(expected)
