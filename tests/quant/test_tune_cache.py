"""The mat-vec tuning cache: choices survive a restart, bad files are ignored, nothing is kept when asked."""
from __future__ import annotations

import json

import pytest
import torch

from hf2q.kernels.tuning import cache as tune_cache


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "configs.json"
    monkeypatch.setenv("HF2Q_TUNE_CACHE", str(path))
    return path


def test_round_trip_by_scope(cache_file):
    tune_cache.store("H200 | triton 3.6 | abc", "Q4_K|4096|0|4096|1|False", (1, 16, 1, 1))
    tune_cache.store("H200 | triton 3.6 | abc", "Q6_K|1024|0|4096|1|False", (2, 8, 1, 1))
    tune_cache.store("H100 | triton 3.6 | abc", "Q4_K|4096|0|4096|1|False", (4, 8, 1, 1))
    assert tune_cache.load("H200 | triton 3.6 | abc") == {"Q4_K|4096|0|4096|1|False": [1, 16, 1, 1],
                                                         "Q6_K|1024|0|4096|1|False": [2, 8, 1, 1]}
    assert tune_cache.load("H100 | triton 3.6 | abc") == {"Q4_K|4096|0|4096|1|False": [4, 8, 1, 1]}
    assert tune_cache.load("H200 | triton 3.7 | abc") == {}
    assert not list(cache_file.parent.glob("*.tmp"))  # written by rename, no leftovers


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"scope": [1]}'])
def test_bad_file_is_ignored_and_rewritten(cache_file, content):
    cache_file.parent.mkdir(parents=True)
    cache_file.write_text(content)
    assert tune_cache.load("scope") == {}
    tune_cache.store("scope", "k", (1, 2, 3, 4))
    assert json.loads(cache_file.read_text())["scope"] == {"k": [1, 2, 3, 4]}


def test_empty_setting_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HF2Q_TUNE_CACHE", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tune_cache.store("scope", "k", (1, 2, 3, 4))
    assert tune_cache.load("scope") == {} and not any(tmp_path.iterdir())


def test_default_place_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("HF2Q_TUNE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune_cache.cache_path() == tmp_path / "hf2q" / "matvec_configs.json"


def test_unwritable_place_warns_and_goes_on(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HF2Q_TUNE_CACHE", str(blocker / "configs.json"))  # its parent is a file
    with pytest.warns(UserWarning, match="not written"):
        tune_cache.store("scope", "k", (1, 2, 3, 4))
    assert tune_cache.load("scope") == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_second_start_takes_the_stored_choice_without_timing(cache_file, monkeypatch):
    from hf2q.kernels.quant import dp4a_triton as k
    from hf2q.quant import random_blocks

    raw = random_blocks("Q4_K", 64, 512, seed=3).cuda()
    xs = k.quantize_rows(torch.randn(1, 512, device="cuda"))
    monkeypatch.setattr(k, "_TUNED", {})
    first = k.best_config(xs, raw, "Q4_K", 64, None)
    monkeypatch.setattr(k, "_TUNED", {})  # a new process: only the file remembers

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    monkeypatch.setattr(k, "graph_time_us", no_timing)
    assert k.best_config(xs, raw, "Q4_K", 64, None) == first


def test_scope_hash_ignores_prose_not_code():
    code_hash = tune_cache.code_hash
    src = 'def f(x):\n    """Why."""\n    return x + 1  # note\n'
    assert code_hash(src) == code_hash('def f(x):\n    """Why, said otherwise."""\n    return x + 1\n')
    assert code_hash(src) == code_hash('def f(x):\n    return x + 1\n')
    assert code_hash(src) != code_hash('def f(x):\n    """Why."""\n    return x + 2\n')
    other = 'def g(y):\n    return y * 2\n'  # a second module of the same kernel counts as well
    assert code_hash(src, other) == code_hash('def f(x):\n    return x + 1\n', other)
    assert code_hash(src, other) != code_hash(src, other.replace("2", "3")) != code_hash(src)


def test_first_start_compiles_the_candidates_side_by_side():
    """Before timing, every candidate is bound (warm: compile without launching) on the calling thread with
    Triton's asynchronous compile mode open, so its compilation goes to the pool (tests/kernels/
    test_parallel_compile.py compiles real ones for sm_90); a failure only warns (the timed launches then compile
    for themselves)."""
    import threading

    pytest.importorskip("triton")
    from triton.runtime import _async_compile

    from hf2q.kernels.quant import dp4a_triton as q8

    seen = {}

    def warm(config):
        seen[config] = (threading.get_ident(), _async_compile.active_mode.get() is not None)

    configs = [(1, 16, 1, 1), (2, 16, 1, 1), (4, 8, 1, 1), (8, 8, 2, 1)]
    q8._precompile(warm, configs)
    assert seen == {config: (threading.get_ident(), True) for config in configs}
    assert _async_compile.active_mode.get() is None  # closed again

    def broken(config):
        if config == configs[2]:
            raise RuntimeError("no ptxas")

    with pytest.warns(UserWarning, match="one by one"):
        q8._precompile(broken, configs)
