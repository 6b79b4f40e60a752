"""The tiny models, loaded once for every tensor-parallel test of the session."""
from __future__ import annotations

import pytest

import hf2q


@pytest.fixture(scope="session")
def tp_models(request) -> dict:
    models = {kind: hf2q.load(request.getfixturevalue(f"gguf_{kind}_f32")) for kind in ("dense", "moe")}
    # blocks kept as on CUDA (Q8_0 is read the same way on the CPU): every projection and the LM head are
    # cut by whole blocks
    models["dense-q8_0"] = hf2q.load(request.getfixturevalue("gguf_dense_q8_0"), keep_quantized=True)
    return models
