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
