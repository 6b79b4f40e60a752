"""A model that cannot fit is refused before loading: the bytes the loader will keep are counted from the
file's tensor table (equal to what loading then holds), and a device with less free memory gets one error
that says how much is needed, how much is free and what would need less."""
from __future__ import annotations

import pytest
import torch

import hf2q
from hf2q.checkpoint import footprint
from hf2q.checkpoint.gguf_file import GGUFFile
from hf2q.config import ModelConfig


def held_bytes(net) -> int:
    """Bytes of every weight the model holds: parameters and kept blocks, each storage once (packed
    projections are views of one)."""
    tensors = list(net.parameters()) + [b for n, b in net.named_buffers() if n.endswith(("qweight", "_qexps"))]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("fixture,keep", [("gguf_moe_f32", False), ("gguf_dense_q4_k_m", True)])
def test_counted_bytes_are_what_loading_holds(fixture, keep, request):
    path = request.getfixturevalue(fixture)
    gguf = GGUFFile(path)
    layers = ModelConfig.from_gguf_metadata(gguf.metadata).num_layers
    model = hf2q.load(path, keep_quantized=keep)
    assert footprint.loaded_bytes(gguf, layers, torch.float32, keep) == held_bytes(model.net)


def test_a_model_too_large_is_refused_before_loading(gguf_dense_q4_k_m, monkeypatch, capsys):
    from hf2q.cli import main

    gguf = GGUFFile(gguf_dense_q4_k_m)
    need = footprint.loaded_bytes(gguf, ModelConfig.from_gguf_metadata(gguf.metadata).num_layers, torch.float32,
                                  False)
    monkeypatch.setattr(footprint, "free_bytes", lambda device: need - 1)
    with pytest.raises(footprint.ModelTooLarge, match=r"needs about .* GiB of CPU memory .* --dtype bfloat16"):
        hf2q.load(gguf_dense_q4_k_m)
    assert main(["generate", "--model", str(gguf_dense_q4_k_m), "--prompt", "hi", "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "GiB is free" in err and "Traceback" not in err
