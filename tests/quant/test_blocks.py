"""Random quantized blocks are valid GGUF blocks with sane values, and quantized Linears hold bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf2q.layers.linear import Linear
from hf2q.quant import QUANT_TYPES, block_layout, dequantize_ref, random_blocks, row_bytes


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_random_blocks_dequantize_to_sane_values(qtype):
    raw = random_blocks(qtype, 6, 512, std=0.02, seed=3)
    assert raw.dtype == torch.uint8 and raw.shape == (6, row_bytes(qtype, 512))
    w = dequantize_ref(raw, qtype, (6, 512))
    assert torch.isfinite(w).all()
    assert 0.01 < float(w.std()) < 0.06 and float(w.abs().max()) < 0.2
    assert abs(float(w.mean())) < 0.01
    assert len(torch.unique(w)) > 100  # quants vary, not one repeated code
    assert not torch.equal(raw, random_blocks(qtype, 6, 512, std=0.02, seed=4))


def test_k_scales_round_trip_through_gguf():
    """Every 6-bit scale and min packed into Q4_K's 12-byte field is read back by gguf's unpacker."""
    from gguf.quants import Q4_K

    raw = random_blocks("Q4_K", 64, 256, seed=1).numpy()
    sc, mn = Q4_K.get_scale_min(raw[:, 4:16].copy())
    assert sc.min() >= 40 and sc.max() <= 63 and mn.min() >= 40 and mn.max() <= 63
    assert len(np.unique(sc)) > 10


def test_row_bytes_refuses_partial_blocks():
    assert row_bytes("Q6_K", 512) == 2 * block_layout("Q6_K")[1]
    with pytest.raises(ValueError):
        row_bytes("Q4_K", 128)


def test_quantized_linear_drops_dense_weight_and_matches_reference():
    lin = Linear(256, 20)
    raw = random_blocks("Q5_K", 20, 256)
    lin.set_quantized(raw, "Q5_K")
    assert lin.weight is None and lin.quantized and "weight" not in dict(lin.named_parameters())
    x = torch.randn(3, 2, 256)
    want = x @ dequantize_ref(raw, "Q5_K", (20, 256)).T
    assert torch.allclose(lin(x), want, atol=1e-6, rtol=0)
    with pytest.raises(ValueError):
        Linear(256, 21).set_quantized(raw, "Q5_K")
