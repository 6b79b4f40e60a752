"""Mat-vec configurations timed on this device, kept across starts.

Timing every candidate configuration of every shape makes the first start of a 9B Q4_K_M model take about
a minute and a half on an H200; a later start reads the choices back and compiles only the chosen ones.
Entries are scoped by GPU name, Triton version and a hash of the kernel modules' code (code_hash: not its
comments or docstrings): another card, compiler or kernel times anew. HF2Q_TUNE_CACHE names the file
(default: hf2q/matvec_configs.json under XDG_CACHE_HOME or ~/.cache); set it empty to keep nothing on disk.
Any candidate is exact, so a stale or foreign entry can cost speed, never correctness.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

from hf2q import envs


def cache_path() -> Path | None:
    return envs.tune_cache()


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # missing or unreadable: time anew, and the next store rewrites it
        return {}
    return data if isinstance(data, dict) else {}


def load(scope: str) -> dict[str, list]:
    """The stored choices of one scope: key string -> configuration (a list)."""
    path = cache_path()
    entries = _read(path).get(scope, {}) if path else {}
    return entries if isinstance(entries, dict) else {}


def store(scope: str, key: str, config) -> None:
    """Add one choice; written to a temporary file and renamed over the old one, so a reader never sees
    half a file. A file that cannot be written leaves the choice in memory only (with a warning)."""
    path = cache_path()
    if path is None:
        return
    data = _read(path)
    if not isinstance(data.get(scope), dict):
        data[scope] = {}
    data[scope][key] = list(config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as err:
        warnings.warn(f"mat-vec tuning cache {path} not written: {err}", stacklevel=2)


def code_hash(*sources: str) -> str:
    """A digest of Python sources (the modules of one kernel) that changes with their code, not with their
    comments or docstrings (an edit of the prose keeps the stored choices)."""
    digest = hashlib.sha256()
    for source in sources:
        tree = ast.parse(source)
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        digest.update(ast.dump(tree).encode())
    return digest.hexdigest()[:16]
