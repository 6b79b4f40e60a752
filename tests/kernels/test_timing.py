"""The configuration sweeps' shared loop (kernels/timing.time_configs): what it keeps, what it leaves out."""
from __future__ import annotations

from hf2q.kernels.tuning.timing import describe, time_configs


def test_sweep_keeps_exact_configurations_fastest_first(capsys):
    """A configuration whose output is off, or whose kernel does not compile, is reported and left out; the
    rest come back fastest first."""
    errors = {"a": 1e-4, "b": 5e-2, "c": 0.0, "d": None}
    speeds = {"a": 3.0, "c": 2.0}

    def error_of(config):
        if errors[config] is None:
            raise RuntimeError("out of shared memory")
        return errors[config]

    assert time_configs("abcd", error_of, speeds.get) == [(2.0, "c"), (3.0, "a")]
    printed = capsys.readouterr().out
    assert "b: relative error 5.00e-02, skipped" in printed and "d: RuntimeError out of shared memory" in printed


def test_sweep_line_names_the_reference_beside_the_fastest():
    times = [(2.0, (16, 32, 4)), (2.5, (8, 64, 4)), (3.0, (4, 16, 8))]
    assert describe(times, (8, 64, 4), "served", top=2) == \
        "served (8, 64, 4) 2.50 µs; fastest (16, 32, 4) 2.00, (8, 64, 4) 2.50"


def test_spent_counts_what_each_phase_cost(monkeypatch):
    """The warm-up's log line: shapes timed and seconds per phase since a snapshot, each clock adding only to its
    own field."""
    from hf2q.kernels.tuning import timing

    now = iter([10.0, 12.5, 20.0, 20.25])
    monkeypatch.setattr(timing, "SPENT", timing.Spent(shapes=3, compile_s=1.0))
    monkeypatch.setattr(timing.time, "monotonic", lambda: next(now))
    before = timing.SPENT.snapshot()
    timing.SPENT.shapes += 1
    with timing.clock("compile_s"):
        pass
    with timing.clock("timing_s"):
        pass
    assert timing.SPENT == timing.Spent(shapes=4, compile_s=3.5, timing_s=0.25)
    assert timing.SPENT.since(before) == "1 mat-vec shapes timed: compiling 2.5 s, timing 0.2 s"
