"""The int8 tensor-core kernel for batched decode (kernels/quant/mmq_triton) against the dp4a mat-vec, which
reads the same int8 activation rows, and against gguf's dequantization + an fp64 matmul.

Both int8 kernels compute the same integer dots of the same int8 activations and scale them the same way
(Q4_K: d·sc·dx·Σ(q - 8)·xq + (8·d·sc - dmin·m)·Σx per 32-value group, Q5_K likewise around 16; Q6_K:
d·sc·dx·Σ(q - 32)·xq per 16-value piece); only the order of their fp32 sums differs, and mmq takes the Σx
terms through tf32
dots of split operands (22 significant bits a product). So they agree to MMQ_TOL of the largest output:
a few roundings at 2^-22 of each of the K/32 group terms, which are a few times the output (measured
under the interpreter: below 3e-7). Their common distance from the exact product is the int8 rounding of
the activations (under 1e-2 relative here, as in test_kernels): 500 times the tolerance.

Runs on CPU through Triton's interpreter (small shapes), and on a CUDA GPU (a 4096-wide shape too)."""
from __future__ import annotations

import re

import pytest
import torch

from hf2q.quant import KQUANTS, dequantize_ref, random_blocks, to_gpu_rows
from tests.support.triton_targets import INTERPRET, TARGETS, interpreter_child, rel, target

triton = pytest.importorskip("triton")

MMQ_TOL = 1e-5


@pytest.fixture(scope="module", params=TARGETS)
def target_of(request):
    """(device, real sizes?)"""
    dev, _, real = target(request.param)
    return dev, real


@pytest.fixture
def dev(target_of):
    return target_of[0]


test_kernels_under_the_interpreter = interpreter_child(__file__)


def kernel_blocks(raw, qtype):
    """Blocks as the kernels read them: K-quants in interleaved rows, Q8_0 as ggml's bytes."""
    return to_gpu_rows(raw, qtype) if qtype in KQUANTS else raw


def _rows(rows8, m):
    """The first m activation rows of Int8Rows (a batch of m)."""
    return type(rows8)(rows8.xq[:m].clone(), rows8.act[:m].clone(), rows8.blocked)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_mmq_matches_the_int8_matvec_and_ignores_the_batch(target_of, qtype):
    """Weight rows not a multiple of BLOCK_N, K split over programs (and not), batches of 5, 16 and 64
    rows: each row's result is bitwise the same whatever the batch, and within MMQ_TOL of the mat-vec's
    on the same int8 rows."""
    from hf2q.kernels.quant.dp4a_triton import candidates, matvec
    from hf2q.kernels.quant.int8_rows import blocked_for, quantize_rows
    from hf2q.kernels.quant.mmq_triton import quant_mmq

    dev, real = target_of
    n, k = (1029, 4096) if real else (37, 768)  # 9B's 4096-wide rows, or scaled down to three blocks
    k += 32 if qtype == "Q8_0" else 0  # and a partial last tile of 32-value blocks
    raw = random_blocks(qtype, n, k, seed=5)
    kept = kernel_blocks(raw, qtype).to(dev)
    want = torch.randn(64, k, generator=torch.Generator().manual_seed(7)).double() @ \
        dequantize_ref(raw, qtype, (n, k)).double().T
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(7)).to(dev)
    rows8 = quantize_rows(x, blocked=blocked_for(qtype))
    for cfg in ((64, 4, 1), None)[qtype != "Q4_K":]:  # (Q4_K) one split of K; the default (three)
        full = quant_mmq(rows8, kept, qtype, n, cfg=cfg)
        assert full.shape == (64, n) and full.dtype == torch.float32
        assert rel(full, want) < 1e-2
    for m in (5, 16):
        assert torch.equal(quant_mmq(_rows(rows8, m), kept, qtype, n), full[:m]), m
    cfg = None if INTERPRET else candidates(qtype, 2)[0]  # the device's default: no timing of candidates
    dp4a = matvec(_rows(rows8, 2), kept, qtype, n, config=cfg).cpu()
    assert float((full[:2].cpu() - dp4a).abs().max()) <= MMQ_TOL * float(want.abs().max())
    assert torch.equal(quant_mmq(x[:5], kept, qtype, n), full[:5])  # float rows are quantized on the way in


def test_quant_linear_takes_mmq_behind_its_switch(dev, monkeypatch):
    """HF2Q_QUANT_MM=mmq sends 5-64 rows of the weight types mmq_triton reads to it (and has the kernels
    that produce its inputs write their int8 rows) and leaves the others (Q4_0) on the tile kernel;
    the default (tile) leaves them all there; packed gives the K-quants the tile kernel's bf16 fmas."""
    from hf2q import envs
    from hf2q.kernels.quant import ops
    from hf2q.kernels.quant.mm_triton import quant_mm
    from hf2q.kernels.quant.mmq_triton import quant_mmq

    assert ops.QUANT_MM == "tile" and envs.QUANT_MM.default == "tile"
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).to(dev)
    kept = {q: kernel_blocks(random_blocks(q, 3, 256), q).to(dev) for q in ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0")}
    for mode in ("tile", "packed", "mmq"):  # mmq last: the int8 readers below are its
        monkeypatch.setattr(ops, "QUANT_MM", mode)
        for qtype, raw in kept.items():
            mmq = mode == "mmq" and qtype != "Q4_0"
            want = quant_mmq(x, raw, qtype, 3) if mmq else quant_mm(x, raw, qtype, 3, packed=mode == "packed")
            assert torch.equal(ops.quant_linear(x, raw, qtype, 3), want), (mode, qtype)
            if mode == "packed":  # the K-quants' values rounded to bf16 differ; Q8_0 and Q4_0 keep the tile kernel's
                assert torch.equal(want, quant_mm(x, raw, qtype, 3)) == (qtype in ("Q8_0", "Q4_0")), qtype
    rows40 = torch.zeros(40, 256).to(dev)  # producers write int8 rows for mmq's types, not the tile kernel's
    assert [ops.int8_reader(rows40, q) for q in ("Q4_K", "Q4_0")] == ["Q4_K", None]
    assert ops.int8_reader(torch.zeros(65, 256).to(dev), "Q4_K") is None
    monkeypatch.setattr(ops, "QUANT_MM", "tile")
    assert ops.int8_reader(rows40, "Q4_K") is None and ops.int8_reader(rows40[:4], "Q5_K") == "Q5_K"
    monkeypatch.setenv("HF2Q_QUANT_MM", "int8")
    with pytest.raises(ValueError, match="HF2Q_QUANT_MM must be tile, packed or mmq"):
        envs.quant_mm()


def test_mmq_refuses_what_it_does_not_read(dev):
    from hf2q.kernels.quant.int8_rows import quantize_rows
    from hf2q.kernels.quant.mmq_triton import quant_mmq

    x = torch.randn(5, 256).to(dev)
    kept = to_gpu_rows(random_blocks("Q4_K", 3, 256), "Q4_K").to(dev)
    with pytest.raises(ValueError, match="BLOCKED"):
        quant_mmq(quantize_rows(x), kept, "Q4_K", 3)
    with pytest.raises(ValueError, match="Q4_0"):
        quant_mmq(x, random_blocks("Q4_0", 3, 256).to(dev), "Q4_0", 3)
    with pytest.raises(ValueError, match="in order"):
        quant_mmq(quantize_rows(x, blocked=True), random_blocks("Q8_0", 3, 256).to(dev), "Q8_0", 3)


@pytest.mark.parametrize("qtype", ["Q5_K", "Q6_K"])
def test_mmq_compiles_to_int8_tensor_core_dots(qtype):
    """The kernel compiles for sm_90 (no GPU needed; Q5_K's and Q6_K's bit operations are PTX, which the
    interpreter does not run) with its group dots on int8 tensor cores (16 rows: 64 take ptxas three times as long);
    Q5_K's group sums become floats without int-to-float conversions (Q6_K's joined sums reach 2^27: converted)."""
    from tests.support.triton_targets import compile_for_hopper
    from hf2q.kernels.quant import mmq_triton as mmq

    sig = {"xq8": "*i8", "act": "*fp32", "w8": "*i8", "w32": "*i32", "out_ptr": "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "row_stride": "i32", "nblk": "i32", "tiles_per_split": "i32", "n_tiles": "i32"}
    ptx = compile_for_hopper(mmq._mmq_kernel, sig, dict(QTYPE=mmq.QTYPE_ID[qtype], CHUNKS=1,
                             BLOCK_N=mmq.config(4096, 4096, 16)[0], EMULATE=False), 4,
                             ("N", "K", "nblk"))
    assert re.search(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.(satfinite\.)?s32\.s8\.s8\.s32", ptx)
    conversions = len(re.findall(r"cvt\.rn\.f32\.s32\b", ptx))
    assert (conversions == 0) == (qtype == "Q5_K"), conversions
