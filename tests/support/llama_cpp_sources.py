"""Files from llama.cpp's sources, taken from the `llama-cpp-python` sdist on PyPI.

The Qwen3.5 chat template (`models/templates/Qwen3.5-4B.jinja`) and llama.cpp's own GGUF converter
are the references our template renderer and converter are checked against. The sdist is fetched once
with pip into a cache folder; when it cannot be fetched, callers skip.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from functools import lru_cache
from pathlib import Path

SDIST_VERSION = "0.3.36"
CACHE = Path(os.environ.get("HF2Q_TEST_CACHE", Path.home() / ".cache" / "hf2q-tests"))


class SourcesUnavailable(RuntimeError):
    pass


@lru_cache(maxsize=1)
def llama_cpp_root() -> Path:
    """Unpacked `vendor/llama.cpp` folder (only the parts the tests need)."""
    root = CACHE / f"llama_cpp_python-{SDIST_VERSION}"
    marker = root / ".unpacked"
    if marker.exists():
        return root / "vendor" / "llama.cpp"
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not sdist.exists():
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={SDIST_VERSION}", "-d", str(CACHE)],
            capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not sdist.exists():
            raise SourcesUnavailable(f"could not fetch llama-cpp-python sdist: {proc.stderr[-500:]}")
    prefix = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
    wanted = (prefix + "convert_hf_to_gguf.py", prefix + "gguf-py/", prefix + "conversion/",
              prefix + "models/templates/")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(wanted)]
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Pythons before 3.11.4 lack filters
        tar.extractall(CACHE, members=members, **safe)
    marker.touch()
    return root / "vendor" / "llama.cpp"


def qwen35_chat_template() -> str:
    return (llama_cpp_root() / "models" / "templates" / "Qwen3.5-4B.jinja").read_text()


def llama_cpp_converter() -> Path:
    return llama_cpp_root() / "convert_hf_to_gguf.py"
