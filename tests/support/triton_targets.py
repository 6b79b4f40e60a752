"""Where the Triton kernel tests run: under Triton's interpreter on CPU (small sizes, fp32), or on a CUDA
GPU (real sizes, bf16). The interpreter must be switched on before triton is imported, so a CPU run
re-runs the test file in a child process with TRITON_INTERPRET=1."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TARGETS = ["interpret", "cuda"]


@contextlib.contextmanager
def torch_only():
    """Run the choosers' torch versions even while the interpreter is on."""
    old = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old


@contextlib.contextmanager
def bf16_rounding_as_gpu():
    """Triton's interpreter turns float32 into bfloat16 by truncation (and its round-to-nearest mode loses
    the carry into the exponent); a GPU rounds to nearest even. Inside this context the interpreter rounds
    as the GPU does, so a bf16 kernel's error under it is the GPU's (the tiny model's bf16 logits: 0.183 from
    fp32 with truncation, 0.043 rounded)."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    real = interpreter._convert_float

    def convert(values, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            bits = np.ascontiguousarray(values).view(np.uint32).astype(np.uint64)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return real(values, src, dst, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = real


def target(name: str) -> tuple[str, torch.dtype, bool]:
    """(device, dtype, real sizes?) of a target, skipping the test where that target cannot run."""
    if name == "interpret" and not INTERPRET:
        pytest.skip("interpreter runs in its own process (test_kernels_under_the_interpreter)")
    if name == "cuda" and (INTERPRET or not torch.cuda.is_available()):
        pytest.skip("needs CUDA")
    return ("cuda", torch.bfloat16, True) if name == "cuda" else ("cpu", torch.float32, False)


def _cores() -> int:
    """Children a file's interpreter run is split over when nothing else runs beside it: up to two cores."""
    return max(1, min(2, os.cpu_count() or 1))


def start_under_interpreter(path: str, keyword: str, shards: int, background: bool = False) -> list:
    """Child pytest processes that run the tests of `path` that `keyword` (pytest's -k) selects under Triton's
    interpreter, split over `shards` of them (--shard); a background one runs at the lowest priority (nice 19).
    Returns [(process, stdout file, stderr file)]."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    started = []
    for i in range(shards):
        out, err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path, "-k", keyword,
                                 "--shard", f"{i}/{shards}"], env=env, stdout=out, stderr=err, text=True,
                                preexec_fn=(lambda: os.nice(19)) if background else None)
        started.append((proc, out, err))
    return started


# (path, keyword) -> children started right after collection (start_in_background), until their test takes them.
_STARTED: dict[tuple[str, str], list] = {}


def start_in_background(runs: list[tuple[str, str]], alone: bool) -> None:
    """Start the interpreter children of the selected tests `runs` [(path, keyword)] as soon as the session is
    collected. The rest of the suite keeps about one core busy (the test process, or a server it waits on), so
    the children run at the lowest priority on the core left idle and their tests find them done; `alone` (the
    session selected nothing else) splits each file over two cores instead."""
    if INTERPRET:
        return
    shards = _cores() if alone else 1
    for path, keyword in runs:
        if (path, keyword) not in _STARTED:
            _STARTED[(path, keyword)] = start_under_interpreter(path, keyword, shards, background=not alone)


def stop_background() -> None:
    """End the children no test took (a session stopped early by -x or Ctrl-C)."""
    for started in _STARTED.values():
        _end(started)
    _STARTED.clear()


def _end(started: list) -> None:
    for proc, *files in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in files:
            f.close()


def run_under_interpreter(path: str, keyword: str, timeout: int = 300) -> None:
    """Run the tests of `path` that `keyword` (pytest's -k) selects in child processes under Triton's interpreter
    (those started after collection, else split over up to two of the machine's cores; the parent only waits),
    and assert that every one passed and none was skipped."""
    started = _STARTED.pop((path, keyword), None)
    if started is None:
        started = start_under_interpreter(path, keyword, _cores())
    try:
        for proc, *_ in started:
            proc.wait(timeout=timeout)
        outputs = []
        for _, *files in started:
            for f in files:
                f.seek(0)
            outputs.append([f.read() for f in files])
    finally:
        _end(started)
    for (proc, *_), (out, err) in zip(started, outputs):
        assert proc.returncode == 0, out[-3000:] + err[-2000:]
        summary = out.strip().splitlines()[-1]
        assert " passed" in summary and "skipped" not in summary, summary


def interpreter_run(path: str, keyword: str):
    """Mark a test that calls run_under_interpreter(path, keyword), so that the session starts its children
    right after collection (tests/conftest.py)."""

    def mark(test):
        test.interpreter_run = (path, keyword)
        return test

    return mark


def interpreter_child(path: str, timeout: int = 300):
    """A test that runs the file's interpreter cases in child processes (collected under the name it is
    assigned to)."""
    keyword = "interpret and not under_the_interpreter"

    @pytest.mark.skipif(INTERPRET, reason="this is the interpreter run")
    @interpreter_run(path, keyword)
    def test_kernels_under_the_interpreter():
        run_under_interpreter(path, keyword, timeout)

    return test_kernels_under_the_interpreter


def rel(a, b) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def randn(*shape, dev, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(dev)


def compile_for_hopper(fn, sig: dict, const: dict, warps: int, multiples_of_16=()) -> str:
    """PTX of kernel fn for sm_90, its pointers 16-byte aligned (as Triton's launcher finds torch's
    allocations), and the integers named in multiples_of_16 known to be such (as the launcher marks sizes
    that are). Needs Triton's bundled ptxas, not a GPU."""
    if INTERPRET:
        pytest.skip("compiles natively")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **const}
    sig = {**sig, **{name: "constexpr" for name in const}}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or n in multiples_of_16}
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    except (FileNotFoundError, RuntimeError) as err:
        if "ptxas" in str(err):
            pytest.skip(f"no ptxas: {err}")
        raise
    return compiled.asm["ptx"]


class NoLaunch(AttributeError):
    """What hopper_driver's stand-in raises where a launch asks it for anything."""


@contextlib.contextmanager
def hopper_driver():
    """Triton's active driver replaced by one that reports an sm_90 CUDA device and stream 0: JIT functions then
    bind, specialise and compile for Hopper (their `warmup`) on a machine without a GPU; a launch raises NoLaunch
    when it asks the driver for more."""
    if INTERPRET:
        pytest.skip("compiles natively")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Hopper:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def __getattr__(self, name):
            raise NoLaunch(f"no launches on the stand-in driver (asked for {name})")

    before = driver._active  # None until something asked for a driver (on a machine without a GPU, none exists)
    driver.set_active(Hopper())
    try:
        yield
    finally:
        driver._active = before
