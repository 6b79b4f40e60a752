"""The watch on kernels Triton builds after the warm-up: it rides Triton's own JIT hooks, names each late
build in the log with its time, counts it for /metrics, and never stops a build or a hook that was there."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from hf2q.kernels.tuning.late_compiles import LateCompiles

knobs = pytest.importorskip("triton").knobs


def test_late_builds_are_logged_counted_and_hooks_chained(caplog):
    seen = []
    before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("before", kw["key"]))
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("after", kw["key"]))
    ticks = iter([1.0, 1.25])
    watch = LateCompiles(clock=lambda: next(ticks))
    try:
        assert watch.install() and watch.install()  # the second is a no-op, not a hook chained to itself
        fn = SimpleNamespace(module="hf2q.kernels.attention.paged_triton", name="_paged_decode_kernel")
        call = dict(key="k1", repr="_paged_decode_kernel[num_warps=8](stride_bt: i32)", fn=fn, compile={},
                    is_manual_warmup=False, already_compiled=False)
        with caplog.at_level(logging.WARNING, logger="hf2q.compiles"):
            assert not knobs.runtime.jit_cache_hook(**call)  # a falsy answer: Triton goes on and builds it
            knobs.runtime.jit_post_compile_hook(**call)
        assert (watch.count, watch.seconds, watch.names) == (1, 0.25, ["_paged_decode_kernel"])
        assert seen == [("before", "k1"), ("after", "k1")]
        assert "_paged_decode_kernel" in caplog.text and "250 ms" in caplog.text and "stride_bt: i32" in caplog.text
        # with the build's specialisation data: what it was specialised on (Triton 3.6's own text names one argument)
        data = {"signature": {"q_ptr": "*bf16", "num_rows": "constexpr", "stride_bt": "i32", "HD": "constexpr"},
                "constant_keys": [[1], [3]], "constant_vals": [1, {"constexpr": 256}], "attrs_keys": [[0], [2]],
                "attrs_vals": [[["tt.divisibility", 16]], [["tt.divisibility", 16]]],
                "options": {"num_warps": 8, "num_stages": 3}}
        ticks = iter([2.0, 2.001])
        with caplog.at_level(logging.WARNING, logger="hf2q.compiles"):
            knobs.runtime.jit_cache_hook(**call | {"compile": {"specialization_data": json.dumps(data)}})
            knobs.runtime.jit_post_compile_hook(**call | {"compile": {"specialization_data": json.dumps(data)}})
        assert "[num_warps=8, num_stages=3](q_ptr%16, num_rows=1, stride_bt%16, HD=256)" in caplog.text
        watch.uninstall()  # the hooks that were there are back
        knobs.runtime.jit_cache_hook(**call)
        assert seen[-1] == ("before", "k1") and watch.count == 2 and knobs.runtime.jit_cache_hook != watch.before
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after


def test_metrics_expose_the_late_builds(monkeypatch):
    from hf2q.kernels.tuning import late_compiles
    from hf2q.server.metrics import Metrics

    monkeypatch.setattr(late_compiles.WATCH, "count", 3)
    monkeypatch.setattr(late_compiles.WATCH, "timings", 2)
    text = Metrics("m").render().decode()
    assert "hf2q_kernels_built_after_warm_up 3.0" in text and "hf2q_kernel_build_seconds_after_warm_up" in text
    assert "hf2q_matvec_shapes_timed_after_warm_up 2.0" in text and "hf2q_matvec_timing_seconds_after_warm_up" in text


def test_late_matvec_timings_are_logged_and_counted_only_while_watching(caplog):
    """The warm-up times mat-vec shapes on purpose (nothing logged); once the server watches, a shape timed while
    serving is a GPU wait a request paid: logged with what was timed, counted."""
    watch = LateCompiles()
    with caplog.at_level(logging.WARNING, logger="hf2q.compiles"):
        watch.timed_late("Q4_K|4096|0|16384|2|False -> (32, 2)", 0.5)
        assert watch.timings == 0 and not caplog.text
        watch.watching = True
        watch.timed_late("Q4_K|4096|0|16384|2|False -> (32, 2)", 0.07)
    assert (watch.timings, round(watch.timing_seconds, 3)) == (1, 0.07)
    assert "mat-vec shape timed after warm-up in 70 ms" in caplog.text and "Q4_K|4096|0|16384|2" in caplog.text
