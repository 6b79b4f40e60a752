"""`hf2q bench --spec-accept`: the forced-acceptance verify rounds run (on the CPU with a tiny shape) and
report tokens/s for every batch and acceptance length."""
from __future__ import annotations

import pytest
import torch

from hf2q.bench.spec import format_curve, spec_curve
from hf2q.bench_shapes import random_model, tiny_config


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_curve_has_every_batch_and_length(graphs, monkeypatch):
    """Eagerly, and through the decode and verify graphs (on the CPU their stand-in) as the server runs them."""
    from hf2q.engine.prefill_graphs import PrefillGraphs
    from hf2q.kernels.choose import fast_path

    verified, step = [], PrefillGraphs.step
    monkeypatch.setattr(PrefillGraphs, "step", lambda self, seqs, keep=None: (verified.append(self.verify),
                                                                             step(self, seqs, keep))[1])
    cfg = tiny_config()
    net = random_model(cfg, device="cpu", dtype=torch.float32)
    with fast_path("force" if graphs else "auto"):
        report = spec_curve(net, cfg, [1, 3], [0, 2, 3], k=3, prompt=12, rounds=2, graphs=graphs)
    assert verified.count(True) == (2 * 3 * 3 if graphs else 0)  # batches x lengths x (warm-up and 2 rounds)
    assert sorted(report) == sorted(f"spec_b{b}_{n}_tok_s" for b in (1, 3) for n in ("plain", "L0", "L2", "L3"))
    assert all(v > 0 for v in report.values())
    table = format_curve(report, [1, 3], [0, 2, 3])
    assert table.count("\n") == 3 and "L=3" in table
    with pytest.raises(ValueError, match="0..3"):
        spec_curve(net, cfg, [1], [4], k=3)


def test_profile_says_where_a_round_goes():
    """`--profile-spec`: plain steps and the longest forced length at the first batch, with the host's top ops."""
    cfg = tiny_config()
    net = random_model(cfg, device="cpu", dtype=torch.float32)
    report = spec_curve(net, cfg, [2, 3], [1, 2], k=2, prompt=8, rounds=1, graphs=False, profile=True)
    profiles = {key: value for key, value in report.items() if key.endswith("_profile")}
    assert sorted(profiles) == ["spec_b2_L2_profile", "spec_b2_plain_profile"]
    for prof in profiles.values():
        assert prof["wall_ms"] > 0 and prof["gpu_busy_ms"] == 0 and prof["gpu_top"] == []
        assert any("linear" in name or "mm" in name for name, _, _ in prof["host_top"])


def test_profile_spec_alone_is_refused(capsys):
    """`--profile-spec` without `--spec-accept` would profile nothing: refused by name, not ignored."""
    from hf2q.bench import main

    assert main(["--profile-spec"]) == 2
    assert "--spec-accept" in capsys.readouterr().out
