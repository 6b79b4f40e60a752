"""Autotuner candidates compile side by side before they are timed (kernels/tuning/parallel_compile.py): checked
on the CPU by compiling for sm_90 under a stand-in driver, with a timing function that records what was compiled
when each candidate was timed and launches nothing."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from concurrent.futures import ThreadPoolExecutor

from hf2q.kernels.tuning.parallel_compile import compile_candidates_in_parallel, compile_side_by_side
from tests.support.triton_targets import NoLaunch, hopper_driver

CONFIGS = [triton.Config({"BK": bk}, num_warps=w) for bk in (32, 64) for w in (2, 4)]


def _tuner(seen: list):
    def first_timing(kernel_call, quantiles):  # what the kernel's own cache held when a candidate was timed
        seen.append(len(kernel.fn.device_caches[0][0]))
        return [1.0 + len(seen)] * len(quantiles)

    @triton.jit
    def _dot(a, b, c, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm, rn = tl.arange(0, BM), tl.arange(0, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            rk = k + tl.arange(0, BK)
            acc += tl.dot(tl.load(a + rm[:, None] * K + rk[None, :]), tl.load(b + rk[:, None] * BN + rn[None, :]))
        tl.store(c + rm[:, None] * BN + rn[None, :], acc)

    kernel = triton.autotune(configs=CONFIGS, key=["K"], do_bench=first_timing)(_dot)
    return kernel


class _Pointer:  # what the binder specialises a tensor argument on: its address and dtype
    def __init__(self, address: int):
        self.address, self.dtype = address, torch.float16

    def data_ptr(self) -> int:
        return self.address


ARGS, META = (_Pointer(1 << 20), _Pointer(1 << 21), _Pointer(1 << 22), 256), dict(BM=32, BN=32)


def _time_candidates(tuner) -> None:
    """A first launch of the autotuned kernel: its candidates are timed (the recording timing launches nothing),
    then the winner's launch stops at the stand-in driver."""
    with pytest.raises(NoLaunch):
        tuner[(1,)](*ARGS, **META)


@pytest.mark.parametrize("parallel", [False, True])
def test_candidates_are_compiled_before_the_first_is_timed(parallel, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # nothing compiled earlier is found
    seen: list[int] = []
    tuner = _tuner(seen)
    with hopper_driver():
        if parallel:
            # one worker: on Python before 3.11.8 two threads' ast.parse can fail spuriously (the product then
            # compiles the failed ones again as they are timed; the next test)
            with compile_candidates_in_parallel(workers=1) as compiled:
                _time_candidates(tuner)
            assert (compiled.keys, compiled.candidates) == (1, len(CONFIGS)) and compiled.seconds > 0
            assert "4 autotuner candidates of 1 kernel keys" in str(compiled)
        else:
            _time_candidates(tuner)
    assert len(seen) == len(CONFIGS)  # every candidate timed
    assert seen[0] == (len(CONFIGS) if parallel else 0)
    if parallel:  # the timing's own launches find those kernels: nothing compiled twice
        assert seen == [len(CONFIGS)] * len(CONFIGS)
        compiled = list(tuner.fn.device_caches[0][0].values())
        assert all(k.metadata.target.arch == 90 and k.asm["cubin"] for k in compiled)
        assert sorted(k.metadata.num_warps for k in compiled) == [2, 2, 4, 4]
        with hopper_driver():  # each candidate's launch binds to one of them (its lookup compiles nothing new)
            for config in CONFIGS:
                tuner.fn.warmup(*ARGS, grid=(1,), **META, **config.all_kwargs())
        assert len(tuner.fn.device_caches[0][0]) == len(CONFIGS)


def test_the_autotuner_is_left_as_it_was():
    from triton.runtime.autotuner import Autotuner

    before = (Autotuner.prune_configs, Autotuner._bench)
    with compile_candidates_in_parallel(workers=1):
        assert (Autotuner.prune_configs, Autotuner._bench) != before
        with compile_candidates_in_parallel(workers=1):  # a second opening adds nothing
            pass
        assert (Autotuner.prune_configs, Autotuner._bench) != before
    assert (Autotuner.prune_configs, Autotuner._bench) == before


@triton.jit
def _only_bk_32(a, b, c, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    tl.static_assert(BK == 32)
    tl.store(c + tl.arange(0, BM), tl.load(a + tl.arange(0, BM)))


def test_a_candidate_that_fails_to_compile_leaves_nothing_behind(tmp_path, monkeypatch):
    """Some Triton versions keep a failed compilation's placeholder in the kernel's cache, and a launch would
    then raise its error instead of compiling again: none stays."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with hopper_driver(), ThreadPoolExecutor(1) as pool:
        assert compile_side_by_side(lambda c: _only_bk_32.run(*ARGS, grid=(1,), warmup=True, **META, **c.all_kwargs()),
                                    CONFIGS, pool, _only_bk_32)
    compiled = list(_only_bk_32.device_caches[0][0].values())
    assert sorted(k.metadata.num_warps for k in compiled) == [2, 4]  # the two BK = 32 candidates, compiled
