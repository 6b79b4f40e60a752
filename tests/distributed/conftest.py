"""The tiny models, loaded once for every tensor-parallel test of the session."""
from __future__ import annotations

import pytest

import hf2q


@pytest.fixture(scope="session")
def tp_models(request) -> dict:
    return {kind: hf2q.load(request.getfixturevalue(f"gguf_{kind}_f32")) for kind in ("dense", "moe")}
