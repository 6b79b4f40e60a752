"""Loading onto CUDA sends each tensor's file bytes through the pinned staging buffers and decodes them on the
device. The same code runs here on the CPU (plain buffers; block types through gguf's reference) and must
give gguf's values bit for bit; tiny chunks make every tensor cross several buffer turns."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf2q.checkpoint.gguf_file import GGUFFile
from hf2q.checkpoint.loader import _device_value
from hf2q.checkpoint.staging import StagedCopier


def test_copier_carries_bytes_across_chunks():
    src = np.random.default_rng(0).integers(0, 256, 10_007, dtype=np.uint8)
    copier = StagedCopier("cpu", chunk_bytes=1000)
    for part in (src, src[:999], src[:1], src.view(np.uint8)[:8].view(np.float32)):
        out = copier.copy(part)
        assert out.dtype == torch.uint8 and bytes(out.numpy()) == part.tobytes()


@pytest.mark.parametrize("fixture", ["gguf_dense_bf16", "gguf_dense_q4_k_m"])
def test_device_values_equal_host_values(fixture, request):
    gguf = GGUFFile(request.getfixturevalue(fixture))
    copier = StagedCopier("cpu", chunk_bytes=4096)
    kinds = set()
    for name in gguf.tensor_names:
        value = _device_value(gguf, name, copier)
        assert value is not None, name
        assert torch.equal(value, gguf.tensor(name)), name
        kinds.add(gguf.info(name).type_name)
    assert kinds >= ({"BF16", "F32"} if "bf16" in fixture else {"Q4_K", "Q6_K", "F32"}), kinds


def test_dense_models_leave_blocks_to_the_reference(gguf_dense_q4_k_m):
    gguf = GGUFFile(gguf_dense_q4_k_m)
    copier = StagedCopier("cpu")
    assert _device_value(gguf, "token_embd.weight", copier, blocks=False) is None
    assert gguf.info("token_embd.weight").type_name not in ("F32", "F16", "BF16")


@pytest.mark.parametrize("keep_quantized", [True, False])
def test_device_path_builds_the_same_model(gguf_dense_q4_k_m, keep_quantized, monkeypatch):
    """The whole CUDA loading path (bytes staged, then decoded and laid out on the device) run on the CPU."""
    from hf2q.checkpoint import loader
    from hf2q.config import ModelConfig

    def build():
        gguf = GGUFFile(gguf_dense_q4_k_m)
        cfg = ModelConfig.from_gguf_metadata(gguf.metadata)
        return loader.build_model(gguf, cfg, with_mtp=False, keep_quantized=keep_quantized)

    plain = build()
    monkeypatch.setattr(loader, "staged_copier", lambda device: StagedCopier(device, chunk_bytes=1 << 16))
    staged = build()
    a, b = plain.state_dict(), staged.state_dict()
    assert a.keys() == b.keys() and len(a) > 10
    assert any(v.dtype == torch.uint8 for v in a.values()) == keep_quantized  # blocks kept as bytes
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
