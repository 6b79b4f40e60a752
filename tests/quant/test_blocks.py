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


@pytest.mark.parametrize("rows,k", [(21, 256), (5, 768), (3, 4096), (7, 5120), (3, 12288)])
def test_planar_q6_k_round_trips_byte_for_byte(rows, k):
    """Planar rows (the GPU's Q6_K layout) give back ggml's blocks exactly; every plane and every row starts
    on a 16-byte boundary, the row padded only where its block count is not a multiple of 8."""
    from hf2q.quant import planar_row_words, q6_k_from_planar, q6_k_to_planar

    raw = random_blocks("Q6_K", rows, k, seed=rows)
    planar = q6_k_to_planar(raw)
    nb = k // 256
    assert planar.dtype == torch.int32 and planar.shape == (rows, planar_row_words(k))
    assert planar.shape[1] * 4 % 16 == 0 and planar.shape[1] * 4 - 210 * nb == (-210 * nb) % 16
    assert all(start % 16 == 0 for start in (128 * nb, 192 * nb, 208 * nb))
    assert torch.equal(q6_k_from_planar(planar, k), raw)
    flat = planar.view(torch.uint8)
    blocks = raw.view(rows, nb, 210)
    assert torch.equal(flat[:, :128 * nb], blocks[:, :, :128].reshape(rows, -1))  # ql of every block first
    assert torch.equal(flat[:, 208 * nb:210 * nb], blocks[:, :, 208:].reshape(rows, -1))  # d of every block last
    assert not flat[:, 210 * nb:].any()  # padding
    stack = raw.view(rows, 1, -1).expand(rows, 2, -1).contiguous()  # expert stacks: rows stay rows
    assert torch.equal(q6_k_from_planar(q6_k_to_planar(stack), k), stack)


def test_planar_q6_k_layout_is_told_by_dtype():
    """ggml-order Q6_K (uint8) is read by the CPU reference only; planar rows (int32) by the kernels only."""
    from hf2q.kernels.quant_ops import check_raw
    from hf2q.quant import keep_blocks, q6_k_to_planar

    raw = random_blocks("Q6_K", 4, 512)
    planar = q6_k_to_planar(raw)
    with pytest.raises(ValueError, match="planar"):
        dequantize_ref(planar, "Q6_K", (4, 512))
    check_raw(planar, "Q6_K", (4, 512))
    check_raw(raw, "Q6_K", (4, 512))
    with pytest.raises(ValueError):
        check_raw(planar, "Q4_K", (4, 512))
    assert keep_blocks(raw, "Q6_K", "cpu") is raw and keep_blocks(raw, "Q8_0", "meta").dtype == torch.uint8
