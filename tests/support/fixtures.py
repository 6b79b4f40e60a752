"""Shared test fixtures: tiny HF checkpoints, the GGUF files our converter makes from them, and the
ones llama.cpp's converter makes (the reference).

Everything is built lazily, on first request, and cached across runs under
`~/.cache/hf2q-tests/fixtures/<key>`, where the key hashes the code that makes it, so a code change
rebuilds (and folders of the same kind unused for a day are removed). Each file is built under a
temporary name and renamed into place, so two pytest processes never see a half-written one.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from tests.support import llama_cpp_sources
from tests.support.llama_cpp_sources import SDIST_VERSION, SourcesUnavailable

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_SOURCES = ("tests/support/checkpoints.py", "tests/support/tokenizer_dir.py")
CONVERTER_SOURCES = ("src/hf2q/checkpoint/convert.py",)
VL_CHECKPOINT_SOURCES = CHECKPOINT_SOURCES + ("tests/support/vision_checkpoints.py",)
MMPROJ_SOURCES = CONVERTER_SOURCES + ("src/hf2q/checkpoint/convert_mmproj.py",)
REQUANTIZE_SOURCES = ("tests/support/requantize.py", "src/hf2q/quant.py")
TRAINED_SOURCES = ("tests/support/trained_checkpoints.py", "tests/support/checkpoints.py",
                   "tests/support/gguf_variants.py")


def _key(paths: tuple[str, ...], *extra: str) -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    for p in paths:
        h.update(p.encode() + b"\0" + (REPO / p).read_bytes())
    for e in (torch.__version__, transformers.__version__, *extra):
        h.update(e.encode() + b"\0")
    return h.hexdigest()[:16]


def fixture_dir(kind: str) -> Path:
    """Cache folder of "hf" checkpoints, "ours" (GGUFs by our converter) or "llama.cpp" GGUFs.

    Each is keyed by the code that makes it: a converter change rebuilds only our GGUFs (the
    "requantized" K-quant files made from them and the "trained" copiers' included), not the checkpoints.
    """
    if kind == "hf":
        key = "hf-" + _key(CHECKPOINT_SOURCES)
    elif kind == "ours":
        key = _key(CHECKPOINT_SOURCES + CONVERTER_SOURCES)
    elif kind == "hf-vl":
        key = "hf-vl-" + _key(VL_CHECKPOINT_SOURCES)
    elif kind == "ours-vl":
        key = "ours-vl-" + _key(VL_CHECKPOINT_SOURCES + MMPROJ_SOURCES)
    elif kind == "llama.cpp-vl":
        key = "llama.cpp-vl-" + _key(VL_CHECKPOINT_SOURCES, SDIST_VERSION)
    elif kind == "hf-trained":
        key = "hf-trained-" + _key(TRAINED_SOURCES)
    elif kind == "trained":
        key = "trained-" + _key(TRAINED_SOURCES + CONVERTER_SOURCES)
    elif kind == "requantized":
        key = "requantized-" + _key(CHECKPOINT_SOURCES + CONVERTER_SOURCES + REQUANTIZE_SOURCES)
    else:
        key = "llama.cpp-" + _key(CHECKPOINT_SOURCES, SDIST_VERSION)
    return llama_cpp_sources.CACHE / "fixtures" / key


def cached(folder: Path, name: str, build: Callable[[Path], object]) -> Path:
    """`folder/name`, made by `build(tmp_path)` unless already there; safe against parallel builders."""
    target = folder / name
    if target.exists():
        return target
    if not folder.exists():
        _prune_stale(folder)
        folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.{os.getpid()}.tmp"
    _remove(tmp)
    try:
        build(tmp)
        os.rename(tmp, target)  # atomic; a file replaces an equal file from a parallel builder
    except OSError:
        if not target.exists():  # a folder cannot replace one a parallel builder made: keep theirs
            raise
    finally:
        _remove(tmp)
    return target


def _prune_stale(folder: Path, max_age_s: float = 86400) -> None:
    kind = folder.name.rpartition("-")[0]
    for old in folder.parent.glob("*") if folder.parent.exists() else []:
        if old.name.rpartition("-")[0] == kind and time.time() - old.stat().st_mtime > max_age_s:
            shutil.rmtree(old, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def hf_checkpoint(kind: str) -> Path:
    """Tiny random HF checkpoint folder ("dense" or "moe") with MTP weights and the real tokenizer."""
    from tests.support.checkpoints import write_checkpoint

    try:
        return cached(fixture_dir("hf"), f"hf_{kind}", lambda p: write_checkpoint(p, kind))
    except SourcesUnavailable as exc:  # the chat template comes from llama.cpp's sources
        pytest.skip(str(exc))


def our_gguf(kind: str, outtype: str) -> Path:
    """The checkpoint converted by `hf2q convert`."""
    from hf2q.checkpoint.convert import convert

    src = hf_checkpoint(kind)
    return cached(fixture_dir("ours"), f"{kind}-{outtype}.gguf", lambda p: convert(src, p, outtype))


def copier_gguf(kind: str) -> Path:
    """The tiny model trained to continue periodic sequences (tests/support/trained_checkpoints.py), by our
    converter: trained once per cache, in about 15 s, on the CPU."""
    from hf2q.checkpoint.convert import convert
    from tests.support.trained_checkpoints import write_copier_checkpoint

    carried = Path(os.environ.get("HF2Q_TRAINED_FIXTURES", "/nonexistent")) / f"copier-{kind}.gguf"
    if carried.exists():  # built on a CPU machine and carried to one that cannot train it (tools/gpu_carry.sh)
        return carried
    src = cached(fixture_dir("hf-trained"), f"hf_copier_{kind}", lambda p: write_copier_checkpoint(p, kind))
    return cached(fixture_dir("trained"), f"copier-{kind}.gguf", lambda p: convert(src, p, "f32"))


def q4_k_m_gguf(kind: str) -> Path:
    """Our f32 GGUF rewritten with llama.cpp's Q4_K_M types (tests/support/requantize.py)."""
    from tests.support.requantize import write_q4_k_m

    src = our_gguf(kind, "f32")
    return cached(fixture_dir("requantized"), f"{kind}-q4_k_m.gguf", lambda p: write_q4_k_m(src, p))


def llama_cpp_gguf(kind: str, outtype: str, no_mtp: bool = False) -> Path:
    """The checkpoint converted by llama.cpp's own `convert_hf_to_gguf.py`; skips if unavailable."""
    src = hf_checkpoint(kind)

    def build(path: Path) -> None:
        _run_converter([str(src), "--outfile", str(path), "--outtype", outtype] + (["--no-mtp"] if no_mtp else []))

    name = f"{kind}-{outtype}{'-nomtp' if no_mtp else ''}.gguf"
    return cached(fixture_dir("llama.cpp"), name, build)


def _run_converter(args: list[str]) -> None:
    """llama.cpp's `convert_hf_to_gguf.py ARGS`; skips when its sources cannot be fetched."""
    try:
        converter = llama_cpp_sources.llama_cpp_converter()
    except SourcesUnavailable as exc:
        pytest.skip(str(exc))
    proc = subprocess.run([sys.executable, str(converter), *args], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp converter failed:\n{proc.stderr[-3000:]}")


def hf_vl_checkpoint(kind: str) -> Path:
    """Tiny random HF image-text checkpoint ("dense" or "moe"): a text model plus a two-block vision tower."""
    from tests.support.vision_checkpoints import write_vl_checkpoint

    try:
        return cached(fixture_dir("hf-vl"), f"hf_vl_{kind}", lambda p: write_vl_checkpoint(p, kind))
    except SourcesUnavailable as exc:
        pytest.skip(str(exc))


def our_vl_ggufs(kind: str, outtype: str = "f32") -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) of `hf_vl_checkpoint(kind)`, both by `hf2q convert`."""
    from hf2q.checkpoint.convert import convert
    from hf2q.checkpoint.convert_mmproj import convert_mmproj

    src, folder = hf_vl_checkpoint(kind), fixture_dir("ours-vl") / f"{kind}-{outtype}"
    text = cached(folder, f"{kind}-{outtype}.gguf", lambda p: convert(src, p, outtype))
    return text, cached(folder, f"mmproj-{kind}-{outtype}.gguf", lambda p: convert_mmproj(src, p, outtype))


def llama_cpp_mmproj(kind: str, outtype: str) -> Path:
    """The vision projector of `hf_vl_checkpoint(kind)` by llama.cpp's `convert_hf_to_gguf.py --mmproj`."""
    src = hf_vl_checkpoint(kind)

    def build(path: Path) -> None:
        _run_converter([str(src), "--mmproj", "--outfile", str(path), "--outtype", outtype])

    return cached(fixture_dir("llama.cpp-vl"), f"mmproj-{kind}-{outtype}.gguf", build)


def hf_model(kind: str):
    """The HF transformers model of `hf_checkpoint(kind)`, fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_checkpoint(kind), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_dense_dir() -> Path:
    return hf_checkpoint("dense")


@pytest.fixture(scope="session")
def hf_moe_dir() -> Path:
    return hf_checkpoint("moe")


@pytest.fixture(scope="session")
def hf_model_dense():
    return hf_model("dense")


@pytest.fixture(scope="session")
def hf_model_moe():
    return hf_model("moe")


@pytest.fixture(scope="session")
def gguf_dense_f32() -> Path:
    return our_gguf("dense", "f32")


@pytest.fixture(scope="session")
def gguf_moe_f32() -> Path:
    return our_gguf("moe", "f32")


@pytest.fixture(scope="session")
def gguf_dense_bf16() -> Path:
    return our_gguf("dense", "bf16")


@pytest.fixture(scope="session")
def gguf_dense_q8_0() -> Path:
    return our_gguf("dense", "q8_0")


@pytest.fixture(scope="session")
def gguf_moe_q8_0() -> Path:
    return our_gguf("moe", "q8_0")


@pytest.fixture(scope="session")
def gguf_dense_q4_k_m() -> Path:
    return q4_k_m_gguf("dense")


@pytest.fixture(scope="session")
def gguf_moe_q4_k_m() -> Path:
    return q4_k_m_gguf("moe")
