"""Random quantized blocks are valid GGUF blocks with sane values, and quantized Linears hold bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf2q.layers.linear import Linear
from hf2q.quant import AFFINE_TYPES, QUANT_TYPES, affine_groups, block_layout, dequantize_ref, random_blocks, row_bytes


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


@pytest.mark.parametrize("qtype", AFFINE_TYPES)
def test_affine_groups_are_gguf_values_exactly(qtype):
    """scale · code + offset per 32-value group is gguf's dequantization bit for bit, on blocks of random bytes
    (every scale, min and fifth-bit pattern, zero scales too) with finite half-precision d (and dmin)."""
    elems, nbytes = block_layout(qtype)
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (24 * 512 // elems, nbytes), dtype=np.uint8)
    for lo in (0, 2) if qtype in ("Q4_K", "Q5_K") else (0,):
        blocks[:, lo:lo + 2] = rng.uniform(1e-4, 1e-2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    raw = torch.from_numpy(blocks.reshape(24, -1))
    codes, scale, offset = affine_groups(raw, qtype, (24, 512))
    assert codes.dtype == torch.uint8 and int(codes.max()) < 1 << AFFINE_TYPES[qtype]
    values = codes.float().view(24, 16, 32) * scale[..., None] + offset[..., None]
    assert torch.equal(values.view(24, 512), dequantize_ref(raw, qtype, (24, 512)))
    with pytest.raises(ValueError, match="Q6_K"):
        affine_groups(random_blocks("Q6_K", 2, 256), "Q6_K", (2, 256))
    with pytest.raises(ValueError, match="ggml's order"):
        affine_groups(raw, qtype, (24, 256))


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
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_interleaved_rows_round_trip_byte_for_byte(qtype, rows, k):
    """Interleaved rows (the GPU's K-quant layout) give back ggml's blocks exactly: quad q of block u is
    quad q·B + u of its row, Q6_K's d of every block follow in one plane, and every row starts on a
    16-byte boundary (Q6_K padded only where its block count is not a multiple of 8)."""
    from hf2q.quant import QUADS, block_layout, from_gpu_rows, gpu_row_words, to_gpu_rows

    raw = random_blocks(qtype, rows, k, seed=rows)
    kept = to_gpu_rows(raw, qtype)
    nb, size = k // 256, block_layout(qtype)[1]
    quads = QUADS[qtype]
    assert kept.dtype == torch.int32 and kept.shape == (rows, gpu_row_words(qtype, k))
    assert kept.shape[1] * 4 % 16 == 0 and kept.shape[1] * 4 - size * nb == (-size * nb) % 16
    assert torch.equal(from_gpu_rows(kept, qtype, k), raw)
    flat = kept.view(torch.uint8).view(rows, -1)
    blocks = raw.view(rows, nb, size)
    for q in (0, quads - 1):
        for u in (0, nb - 1):
            assert torch.equal(flat[:, 16 * (q * nb + u):16 * (q * nb + u + 1)], blocks[:, u, 16 * q:16 * (q + 1)])
    if qtype == "Q6_K":
        assert torch.equal(flat[:, 208 * nb:210 * nb], blocks[:, :, 208:].reshape(rows, -1))  # d of every block last
    assert not flat[:, size * nb:].any()  # padding
    stack = raw.view(rows, 1, -1).expand(rows, 2, -1).contiguous()  # expert stacks: rows stay rows
    assert torch.equal(from_gpu_rows(to_gpu_rows(stack, qtype), qtype, k), stack)


def test_interleaved_layout_is_told_by_dtype():
    """ggml-order K-quants (uint8) are read by the CPU reference only; interleaved rows (int32) by the
    kernels only."""
    from hf2q.kernels.quant.ops import check_raw
    from hf2q.quant import keep_blocks, to_gpu_rows

    for qtype in ("Q4_K", "Q6_K"):
        raw = random_blocks(qtype, 4, 512)
        kept = to_gpu_rows(raw, qtype)
        with pytest.raises(ValueError, match="interleaved"):
            dequantize_ref(kept, qtype, (4, 512))
        check_raw(kept, qtype, (4, 512))
        check_raw(raw, qtype, (4, 512))
        with pytest.raises(ValueError):
            check_raw(kept, "Q5_K", (4, 512))
        assert keep_blocks(raw, qtype, "cpu") is raw
    with pytest.raises(ValueError, match="ggml-order"):
        to_gpu_rows(random_blocks("Q8_0", 4, 512), "Q8_0")
    assert keep_blocks(random_blocks("Q8_0", 4, 512), "Q8_0", "meta").dtype == torch.uint8
