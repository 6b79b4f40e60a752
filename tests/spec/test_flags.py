"""`--speculative` on `hf2q generate` (same tokens as without) and the speculation counters in /metrics."""
from __future__ import annotations

import json

import pytest

from hf2q.cli import main
from hf2q.server.metrics import Metrics
from hf2q.spec.speculator import SpecStats


def test_generate_with_ngram_or_mtp_gives_the_same_tokens(gguf_dense_f32, capsys):
    prompt = ",".join(str(t) for t in [500, 501, 502, 503, 500, 501, 502])
    got = []
    for extra in ([], ["--speculative", "ngram", "--spec-tokens", "2", "--spec-ngram-min", "1"],
                  ["--speculative", "mtp", "--num-speculative-tokens", "2", "--spec-cost-window", "0"]):
        assert main(["generate", "--model", str(gguf_dense_f32), "--prompt-tokens", prompt, "--max-tokens", "8",
                     "--ignore-eos", "--json", "--device", "cpu", *extra]) == 0
        got.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"])
    assert got[0] == got[1] == got[2] and len(got[0]) == 8


def test_num_speculative_tokens_is_one_to_three(gguf_dense_f32, capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(gguf_dense_f32), "--prompt-tokens", "1", "--speculative", "ngram",
              "--num-speculative-tokens", "4"])
    assert "invalid choice" in capsys.readouterr().err


def test_metrics_count_drafts_and_accepted_tokens():
    class FakeEngine:
        last_batch = (1, 4)
        spec = type("Spec", (), {"stats": SpecStats(rounds=2, drafted=6, accepted=4)})()

    metrics = Metrics("m")
    engine = FakeEngine()
    metrics.observe_step(engine)
    engine.spec.stats.drafted, engine.spec.stats.accepted = 9, 5
    metrics.observe_step(engine)
    text = metrics.render().decode()
    assert "hf2q_spec_decode_num_draft_tokens_total 9.0" in text
    assert "hf2q_spec_decode_num_accepted_tokens_total 5.0" in text
    assert "hf2q_spec_decode_num_drafts_total 2.0" in text
