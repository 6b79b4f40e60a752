"""torch's int4 weight-only kernel on Q4_K / Q4_0 weights (HF2Q_QUANT_MM=int4pack): the affine codes it is
packed from are the blocks' exact values (CPU), and on CUDA its product stays within a stated error of the
dequantized product and gives a row the same result at every row count."""
from __future__ import annotations

import pytest
import torch

from hf2q.kernels.quant import int4pack
from hf2q.quant import affine_groups, dequantize_ref, from_gpu_rows, random_blocks, to_gpu_rows

# Relative (Frobenius) error of the product against x @ dequantized W in bf16: scale and zero rounded to bf16 per
# group of 32 (8 significant bits where a Q4_K scale has up to 17), and the kernel's own bf16 dequantization.
INT4PACK_TOL = 1e-2


@pytest.mark.parametrize("qtype", int4pack.TYPES)
def test_affine_codes_are_the_blocks_values(qtype):
    """Codes 0-15 whose scale * code + offset is the reference dequantization exactly (fp32), the same codes,
    scales and offsets as the numpy reading (hf2q.quant.affine_groups), also from interleaved rows."""
    n, k = 6, 512
    raw = random_blocks(qtype, n, k, std=0.05, seed=11)
    codes, scale, offset = int4pack.affine_codes(raw, qtype, (n, k))
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    values = scale.repeat_interleave(32, dim=1) * codes.float() + offset.repeat_interleave(32, dim=1)
    assert torch.equal(values, dequantize_ref(raw, qtype, (n, k)).float())
    want = affine_groups(raw, qtype, (n, k))
    for got, ref in zip((codes, scale, offset), want):
        assert torch.equal(got, torch.as_tensor(ref).reshape(got.shape)), qtype
    if qtype == "Q4_K":  # the layout CUDA keeps: put back in ggml's order before reading
        assert torch.equal(from_gpu_rows(to_gpu_rows(raw, qtype), qtype, k), raw)


def test_int4pack_refuses_other_types():
    with pytest.raises(ValueError, match="not a 4-bit affine type"):
        int4pack.affine_codes(random_blocks("Q6_K", 2, 256), "Q6_K", (2, 256))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", int4pack.TYPES)
def test_int4pack_product_within_its_bound_and_row_independent(qtype, monkeypatch):
    """1-64 rows (and an odd count) against x @ dequantized W: within INT4PACK_TOL, row 0 bitwise the same at
    every row count, and the engine's dispatch (HF2Q_QUANT_MM=int4pack) takes 5-64 rows here."""
    from hf2q.kernels.quant import ops
    from hf2q.quant import keep_blocks

    n, k = 1000, 4096
    raw = keep_blocks(random_blocks(qtype, n, k, std=0.02, seed=5), qtype, "cuda")
    w = ops.dequantize(raw, qtype, (n, k), torch.bfloat16)
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    first = []
    for m in (1, 5, 16, 37, 64):
        y = int4pack.int4pack_mm(x[:m], raw, qtype, n)
        ref = torch.nn.functional.linear(x[:m], w)
        err = float((y.float() - ref.float()).norm() / ref.float().norm())
        assert err < INT4PACK_TOL, (m, err)
        first.append(y[0])
    assert all(torch.equal(r, first[0]) for r in first)
    monkeypatch.setattr(ops, "QUANT_MM", "int4pack")
    assert torch.equal(ops.quant_linear(x[:16], raw, qtype, n), int4pack.int4pack_mm(x[:16], raw, qtype, n))
