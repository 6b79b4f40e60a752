"""Quantized kernels against gguf's dequantization + an fp32 matmul, every type, odd shapes.

Runs natively on CUDA; on CPU the module re-runs itself in a child process under Triton's interpreter
(TRITON_INTERPRET must be set before Triton decorates the kernels). Tolerances: dequantization within
1e-6 of the largest weight; fp32 dequantize + matmul within 1e-5 relative (Frobenius); bf16 inputs /
tensor-core dots within 1e-2 relative. The decode mat-vec quantizes activations to int8 per 32 values:
on activations that int8 represents exactly it is within 1e-5 relative; on any activations within
2e-2 (the int8 rounding, about 0.5% per dot product, more where K-quant mins cancel).
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from hf2q.quant import KQUANTS, QUANT_TYPES, dequantize_ref, random_blocks, to_gpu_rows
from tests.support.triton_targets import compile_for_hopper, interpreter_run, run_under_interpreter

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA else "cpu"
kernels = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or Triton's interpreter")
SHAPES = [(21, 256), (9, 512), (5, 768)]  # rows not a multiple of the tile; K of one super-block; a partial step


def rel(a, b) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def kernel_blocks(raw, qtype):
    """Blocks as the kernels read them: K-quants in interleaved rows (what keep_blocks gives on CUDA), on DEV."""
    return to_gpu_rows(raw, qtype).to(DEV) if qtype in KQUANTS else raw.to(DEV)


def case(qtype, rows, k, seed=0):
    raw = random_blocks(qtype, rows, k, seed=seed)
    return kernel_blocks(raw, qtype), dequantize_ref(raw, qtype, (rows, k))


CHILD_KEYWORD = "not child_process and not hopper"


@pytest.mark.skipif(CUDA or INTERPRET, reason="kernels run directly here")
@interpreter_run(__file__, CHILD_KEYWORD)
def test_interpreter_child_process():
    """CPU: the kernel tests below, under Triton's interpreter."""
    pytest.importorskip("triton")
    run_under_interpreter(__file__, CHILD_KEYWORD)


@kernels
@pytest.mark.parametrize("qtype,rows,k", [(q, *s) for q in QUANT_TYPES for s in SHAPES]
                         + [("Q8_0", 5, 96), ("Q4_0", 5, 96)]  # a partial tile of 32-value blocks
                         + [("Q6_K", 3, 4096), ("Q6_K", 2, 5120)])  # Q6_K rows: 16-byte multiple, padded
def test_dequantize_kernel(qtype, rows, k):
    from hf2q.kernels.quant.ops import dequantize

    raw, want = case(qtype, rows, k)
    got = dequantize(raw, qtype, (rows, k), torch.float32).cpu()
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
    bf = dequantize(raw, qtype, (rows, k), torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and rel(bf, want) < 1e-2


INT8_TOL = 2e-2  # the decode mat-vec's int8 activations against an fp32 reference


def int8_exact(x):
    """x rounded to what the mat-vec's int8 activation groups hold, so that the kernel sees x exactly."""
    from hf2q.kernels.quant.int8_rows import quantize_rows

    xq, act, _ = quantize_rows(x.to(DEV))
    q = xq.view(torch.int8).view(x.shape[0], -1, 16).float().cpu()
    return (q * act.cpu()[..., :1]).view(x.shape)


@kernels
def test_quantize_rows():
    from hf2q.kernels.quant.int8_rows import quantize_rows

    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    x[1, 32:64] = 0  # an all-zero group
    xq, act = (t.cpu() for t in quantize_rows(x.to(DEV))[:2])
    q = xq.view(torch.int8).view(3, 6, 16).float()
    dx, sq, fix, sx = act.unbind(-1)  # per 16 values; fix and sx of their 32-value group
    for per_group in (dx, fix, sx):
        assert torch.equal(per_group[:, 0::2], per_group[:, 1::2])
    assert float(q.abs().max()) == 127 and float(q[1, 2:4].abs().max()) == 0 and float(dx[1, 2]) == 0
    assert float((q * dx[..., None] - x.view(3, 6, 16)).abs().max()) <= float(dx.max()) / 2 * (1 + 1e-5)
    assert torch.allclose(sq, dx * q.sum(-1), atol=1e-5)
    group_sum = x.view(3, 3, 32).sum(-1)
    assert torch.allclose(sx[:, 0::2], group_sum, atol=1e-5)
    assert torch.allclose(fix[:, 0::2], group_sum - sq[:, 0::2] - sq[:, 1::2], atol=1e-5)


@kernels
def test_quantize_rows_blocked_order():
    """BLOCKED rows (what K-quant weights read) hold the same pieces as plain ones, piece j of 256-value
    block u at j·B + u; the fused producers write the same bytes as quantize_rows in either order."""
    from hf2q.kernels.quant.int8_rows import quantize_rows
    from hf2q.kernels.activation.swiglu_triton import silu_mul

    x = torch.randn(2, 768, generator=torch.Generator().manual_seed(3))
    plain = quantize_rows(x.to(DEV))
    blocked = quantize_rows(x.to(DEV), blocked=True)
    assert not plain.blocked and blocked.blocked
    order = torch.arange(48).view(3, 16).T.reshape(-1)  # blocked position p holds plain piece order[p]
    pieces = lambda r: r.xq.view(torch.int8).view(2, 48, 16).cpu()  # noqa: E731
    assert torch.equal(pieces(blocked), pieces(plain)[:, order])
    assert torch.equal(blocked.act.cpu(), plain.act.cpu()[:, order])
    assert not torch.equal(pieces(blocked), pieces(plain))
    with pytest.raises(ValueError, match="256"):
        quantize_rows(torch.randn(1, 96).to(DEV), blocked=True)
    g = torch.randn(2, 1536, generator=torch.Generator().manual_seed(4)).to(DEV)
    for qtype in ("Q4_K", "Q8_0"):
        h = silu_mul(g[:, :768], g[:, 768:], int8_for=qtype)
        fused = quantize_rows(h, blocked=qtype in KQUANTS)
        fresh = quantize_rows(h.clone(), blocked=qtype in KQUANTS)
        assert torch.equal(fused.xq, fresh.xq) and torch.allclose(fused.act, fresh.act, rtol=1e-6, atol=1e-6)


@kernels
def test_quantize_rows_reuses_recent_inputs_only_while_unchanged():
    from hf2q.kernels.quant.int8_rows import quantize_rows

    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).to(DEV)
    first = quantize_rows(x)
    assert quantize_rows(x) is first  # a second pack of projections of the same input
    other = x.clone()
    assert quantize_rows(other) is not first  # equal values, another tensor
    x256 = torch.randn(1, 256).to(DEV)
    assert quantize_rows(x256, blocked=True) is not quantize_rows(x256)  # each order kept apart
    assert quantize_rows(x) is first  # still kept after another input (an MoE's shared and routed experts)
    for _ in range(4):  # pushed out by four newer inputs
        quantize_rows(torch.randn(2, 64).to(DEV))
    again = quantize_rows(x)
    assert again is not first
    x.mul_(2)  # changed in place: its version counter moves
    doubled = quantize_rows(x)
    assert doubled is not again and torch.allclose(doubled[1][..., 2], 2 * again[1][..., 2])



@kernels
def test_quantize_rows_under_inference_mode():
    """The engine and the bench run under torch.inference_mode, whose tensors have no version counter:
    quantizing them works, and a second pack of projections of the same input reuses the result."""
    from hf2q.kernels.quant.int8_rows import quantize_rows

    with torch.inference_mode():
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)).to(DEV)
        first = quantize_rows(x)
        assert quantize_rows(x) is first
        assert quantize_rows(x.clone()) is not first
    assert torch.equal(first[0], quantize_rows(x.detach().clone())[0])

@kernels
@pytest.mark.parametrize("m", [1, 3, 5, 16, 40, 65])  # int8 mat-vec (1 row), tensor-core tiles (2-64), dequantize + matmul
@pytest.mark.parametrize("rows,k", SHAPES)
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_quant_linear(qtype, rows, k, m):
    from hf2q.kernels.quant.ops import quant_linear

    raw, w = case(qtype, rows, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = x @ w.T
    got = quant_linear(x.to(DEV), raw, qtype, rows)
    assert got.shape == (m, rows) and got.dtype == torch.float32
    assert rel(got, want) < (INT8_TOL if m <= 16 else 1e-2 if CUDA else 1e-5)
    if m <= 16:
        xe = int8_exact(x)
        assert rel(quant_linear(xe.to(DEV), raw, qtype, rows), xe.double() @ w.double().T) < 1e-5
    if CUDA:
        got_bf = quant_linear(x.to(DEV, torch.bfloat16), raw, qtype, rows)
        assert got_bf.dtype == torch.bfloat16 and rel(got_bf, want) < INT8_TOL


@kernels
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_quant_mm(qtype):
    """The tensor-core kernel for batched decode: every type, 1 to 64 activation rows, weight rows not a
    multiple of BLOCK_N, K split over programs or not; each row's result is the same bitwise whatever
    the other rows of the batch (what keeps batched greedy decoding equal to each sequence alone)."""
    from hf2q.kernels.quant.mm_triton import config, quant_mm

    n, k = 37, 768
    raw, w = case(qtype, n, k, seed=5)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(7))
    want = x.double() @ w.double().T
    dtypes = (torch.float32, torch.bfloat16) if CUDA else (torch.float32,)
    for cfg in (None, (32, 4, 2)):
        for dtype in dtypes:
            xd = x.to(DEV, dtype)
            full = quant_mm(xd, raw, qtype, n, cfg)
            assert full.shape == (64, n) and full.dtype == dtype
            assert rel(full, want) < (1e-5 if dtype == torch.float32 else 1e-2), (cfg, dtype)
            for m in (1, 2, 17):
                assert torch.equal(quant_mm(xd[:m].clone(), raw, qtype, n, cfg), full[:m]), (cfg, dtype, m)
            if CUDA:  # 64 rows pipeline two stages deep (pipeline_stages): loads only, the same sums as Triton's 3
                assert torch.equal(quant_mm(xd, raw, qtype, n, cfg, 3), full), (cfg, dtype)
    assert config(n, k)[2] == 3  # few rows, long K: split


def _packed_weights(raw, qtype, n, k):
    """(weights, bound) as HF2Q_QUANT_MM=packed makes them from ggml-order blocks: each value bf16(q * bf16(a) +
    bf16(c)), one rounding (exact in float64 before it), for the group's scale a and offset c (Q4_K/Q5_K: the
    affine groups of 32; Q6_K: d * sc a group of 16, q - 32, no offset), and the stated bound on each value's
    distance from the exact weight: 2^-8 (2 + 2^-8) (|q a| + |c|)."""
    import numpy as np

    from hf2q.quant import affine_groups

    if qtype == "Q6_K":
        w = dequantize_ref(raw, qtype, (n, k)).double()
        blocks = raw.numpy().reshape(-1, 210)  # ql 128, qh 64, 16 int8 scales, f16 d
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float64)
        a = torch.from_numpy(d * blocks[:, 192:208].view(np.int8)).reshape(n, k // 16).repeat_interleave(16, 1)
        q, c = torch.where(a != 0, w / a, 0.0).round(), torch.zeros_like(a)
    else:
        codes, scale, offset = affine_groups(raw, qtype, (n, k))
        q = codes.double()
        a, c = (v.double().repeat_interleave(32, 1) for v in (scale, offset))
    rounded = lambda v: v.float().bfloat16().double()  # noqa: E731
    weights = rounded(q * rounded(a) + rounded(c))
    return weights, 2.0 ** -8 * (2 + 2.0 ** -8) * ((q * a).abs() + c.abs())


@kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_quant_mm_packed(qtype):
    """HF2Q_QUANT_MM=packed: the tile kernel's K-quant values each one bf16 fma of the exact quant with the
    group's scale and min rounded to bf16. Its products are those of exactly those weights (fp32 sums), which
    lie within the stated bound of the exact ones, and each row's result is the same bitwise at any batch."""
    from hf2q.kernels.quant.mm_triton import quant_mm

    n, k = 37, 768
    raw = random_blocks(qtype, n, k, seed=5)
    wp, bound = _packed_weights(raw, qtype, n, k)
    assert ((wp - dequantize_ref(raw, qtype, (n, k)).double()).abs() <= bound).all()
    dtype = torch.bfloat16 if CUDA else torch.float32  # the interpreter's bf16 arithmetic is wrong
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(7)).to(DEV, dtype)
    blocks = kernel_blocks(raw, qtype)
    full = quant_mm(x, blocks, qtype, n, packed=True)
    assert rel(full, x.double().cpu() @ wp.T) < (1e-5 if dtype == torch.float32 else 4e-3)
    for m in (1, 17):
        assert torch.equal(quant_mm(x[:m].clone(), blocks, qtype, n, packed=True), full[:m]), m


def _gemv_cases():
    """Every candidate on the device, and the shared-rows ones of 2-4 rows; under the interpreter (slow) the
    extreme tile sizes."""
    from hf2q.kernels.quant.dp4a_triton import candidates

    extremes = {(4, 8, 1, 1), (2, 2, 4, 1), (4, 32, 1, 1), (4, 4, 4, 1), (8, 2, 4, 3), (8, 4, 4, 3), (16, 2, 1, 1),
                (16, 8, 4, 1, True)}
    every = [(q, c) for q in QUANT_TYPES for c in candidates(q)]
    every += [(q, c) for q in KQUANTS for c in candidates(q, 2) if len(c) > 4]  # shared rows, 2-4 rows
    return [(q, c) for q, c in every if CUDA or c in extremes]


@kernels
@pytest.mark.parametrize("qtype,config", _gemv_cases(),
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v[:4])) + "-shared" * (len(v) > 4))
def test_gemv_every_candidate_config(qtype, config):
    """Every configuration the device may pick is exact on int8-representable activations: rows not a
    multiple of BLOCK_N, a partial step, activation rows not a multiple of BLOCK_M (shared rows: 2 and 4
    rows, and on the device 3, a masked fourth)."""
    from hf2q.kernels.quant.dp4a_triton import gemv

    raw, w = case(qtype, 9, 768, seed=3)
    if len(config) > 4:  # shared rows
        rows = (2, 3, 4) if CUDA else (2, 4)
    else:
        rows = (1, 3) if CUDA else (3,)
    for m in rows:
        x = int8_exact(torch.randn(m, 768, generator=torch.Generator().manual_seed(m)))
        got = gemv(x.to(DEV), raw, qtype, 9, config=config)
        assert rel(got, x.double() @ w.double().T) < 1e-5, m


@kernels
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_gemv_unmasked_when_the_tiles_divide(qtype):
    """Rows, blocks a row and activation rows that are multiples of the tile: the launch drops every mask
    (the kernel's EVEN path), and reads exactly the blocks there are."""
    from hf2q.kernels.quant.dp4a_triton import gemv

    raw, w = case(qtype, 8, 1024, seed=4)
    x = int8_exact(torch.randn(1, 1024, generator=torch.Generator().manual_seed(4)))
    got = gemv(x.to(DEV), raw, qtype, 8, config=(4, 2, 1, 1))
    assert rel(got, x.double() @ w.double().T) < 1e-5


@kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"] if CUDA else ["Q8_0", "Q6_K"])
def test_matvec_two_stacks_one_launch(qtype):
    """Pairs p = (token p // 2, expert e_p): gate and up stacks in one launch give both products, each
    against its own stack, from activations quantized once per token."""
    from hf2q.kernels.quant.dp4a_triton import matvec
    from hf2q.kernels.quant.int8_rows import blocked_for, quantize_rows

    n_exp, n, k = 3, 8, 256
    raws = [random_blocks(qtype, n_exp * n, k, seed=20 + i) for i in range(2)]
    dense = [dequantize_ref(r, qtype, (n_exp, n, k)) for r in raws]
    x = int8_exact(torch.randn(2, k, generator=torch.Generator().manual_seed(4)))
    experts = torch.tensor([2, 0, 1, 2], dtype=torch.int32)
    stacks = [kernel_blocks(r.view(n_exp, n, -1), qtype) for r in raws]
    got = matvec(quantize_rows(x.to(DEV), blocked=blocked_for(qtype)), stacks[0], qtype, n, experts.to(DEV),
                 second=(stacks[1], n),
                 rows_per_x=2).cpu()
    want = torch.stack([torch.cat([d[e] @ x[p // 2] for d in dense]) for p, e in enumerate(experts.tolist())])
    assert got.shape == (4, 2 * n) and rel(got, want) < 1e-5


@kernels
@pytest.mark.parametrize("types", [("Q5_K", "Q4_K"), ("Q4_K", "Q6_K"), ("Q8_0", "Q4_0")])
def test_two_types_one_launch(types, monkeypatch):
    """Projections of one input kept in two types (a DeltaNet's Q5_K qkv and Q4_K z/a/b) come from one
    mat-vec launch through linear_ops.packed_linear, each part exact against its own weight; types that read
    activations in different orders stay two launches. K-quants with shared rows too: 3 rows (a masked
    fourth), or 2 rows each read by two output rows (rows_per_x)."""
    from hf2q.kernels.linear import ops as linear_ops
    from hf2q.kernels.quant import dp4a_triton as quant_dp4a_triton, int8_rows
    from hf2q.layers.linear import Linear

    launches = []
    real_launch = quant_dp4a_triton._launch
    monkeypatch.setattr(quant_dp4a_triton, "_launch", lambda *a, **kw: launches.append(a[2]) or real_launch(*a, **kw))
    k = 512
    x = int8_exact(torch.randn(1, k, generator=torch.Generator().manual_seed(8)))  # one row: the mat-vec's
    for mixed in (types, (types[0], "Q8_0" if types[0] in KQUANTS else "Q4_K")):
        linears, dense = [], []
        for i, (qtype, n) in enumerate(zip((mixed[0], mixed[1], mixed[1]), (64, 32, 8))):
            raw = random_blocks(qtype, n, k, seed=30 + i)
            lin = Linear(k, n)
            lin.set_quantized(kernel_blocks(raw, qtype), qtype)
            linears.append(lin)
            dense.append(dequantize_ref(raw, qtype, (n, k)))
        launches.clear()
        outs = linear_ops.packed_linear(x.to(DEV), linears)
        for got, w in zip(outs, dense):
            assert rel(got, x.double() @ w.double().T) < 1e-5
        one = int8_rows.blocked_for(mixed[0]) == int8_rows.blocked_for(mixed[1])
        assert launches == ([mixed[0]] if one else [mixed[0], mixed[1]]), (mixed, launches)
    if types[1] in KQUANTS:
        raws = [random_blocks(qtype, n, k, seed=40 + i) for i, (qtype, n) in enumerate(zip(types, (16, 5)))]
        dense = torch.cat([dequantize_ref(r, qtype, (r.shape[0], k)) for r, qtype in zip(raws, types)])
        m, per_x = (3, 1) if types[0] == "Q5_K" else (2, 2)
        x = int8_exact(torch.randn(m, k, generator=torch.Generator().manual_seed(9)))
        xs = int8_rows.quantize_rows(x.to(DEV), blocked=True)
        got = quant_dp4a_triton.matvec(xs, kernel_blocks(raws[0], types[0]), types[0], 16, config=(16, 8, 4, 1, True),
                                       second=(kernel_blocks(raws[1], types[1]), 5, types[1]), rows_per_x=per_x)
        assert rel(got, (x.double() @ dense.double().T).repeat_interleave(per_x, 0)) < 1e-5


def expert_stacks(qtype, n_exp, hidden, inter, seed):
    """An MoE's gate, up and down stacks of random `qtype` blocks: ((blocks as the kernels read them, qtype) each,
    their dequantized values [n_exp, out, in] each)."""
    stacks, dense = [], []
    for i, (out, inp) in enumerate([(inter, hidden), (inter, hidden), (hidden, inter)]):
        raw = random_blocks(qtype, n_exp * out, inp, std=0.05, seed=seed + i)
        dense.append(dequantize_ref(raw, qtype, (n_exp, out, inp)))
        stacks.append((kernel_blocks(raw.view(n_exp, out, -1), qtype), qtype))
    return stacks, dense


@kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"] if CUDA else ["Q8_0", "Q6_K"])
def test_moe_experts_quant(qtype, monkeypatch):
    from hf2q.kernels.quant import dp4a_triton as quant_dp4a_triton, moe as quant_moe

    # the interpreter runs every program serially: one token, small experts (32-value blocks where it can),
    # and K-quants in few programs of many rows each
    n_exp, hidden, inter, t, top_k = (4, 256, 256, 3, 2) if CUDA else (4, 64, 96, 1, 2) if qtype == "Q8_0" \
        else (3, 256, 256, 1, 2)
    if not CUDA and qtype == "Q6_K":
        monkeypatch.setattr(quant_dp4a_triton, "_K_CANDIDATES", [(64, 1, 4, 1)])
    stacks, dense = expert_stacks(qtype, n_exp, hidden, inter, seed=10)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, hidden, generator=g)
    experts = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, top_k, generator=g), -1)
    want = torch.zeros(t, hidden)
    for i in range(t):
        for j in range(top_k):
            e = experts[i, j]
            h = torch.nn.functional.silu(dense[0][e] @ x[i]) * (dense[1][e] @ x[i])
            want[i] += weights[i, j] * (dense[2][e] @ h)
    from hf2q.kernels.moe.ops import moe_combine

    got = moe_combine(quant_moe.moe_expert_pairs_quant(x.to(DEV), experts.to(DEV), *stacks), weights.to(DEV))
    assert rel(got, want) < INT8_TOL


@kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"] if CUDA else ["Q4_K"])
def test_moe_experts_read_once_a_block_of_pairs(qtype, monkeypatch):
    """From MOE_BLOCKS pairs the pairs go by expert in blocks of four (their layout equal to its torch oracle) and
    each block's expert is read once for its pairs: every pair's SwiGLU expert within the int8 tolerance of the
    dequantized reference, and bitwise the same among fewer pairs (a pair's result is its own)."""
    from hf2q.kernels.moe.blocks_triton import expert_blocks, expert_blocks_ref
    from hf2q.kernels.quant import dp4a_experts_triton, moe as quant_moe

    # under the interpreter, which pays per program, two tokens over three experts (one expert has two pairs) and
    # wide programs
    n_exp, hidden, inter, t, top_k = (16, 512, 256, 40, 4) if CUDA else (3, 256, 256, 2, 2)
    if not CUDA:
        monkeypatch.setattr(dp4a_experts_triton, "config", lambda qtype, n, k, second: (256, 1, 4, 1, True))
    stacks, dense = expert_stacks(qtype, n_exp, hidden, inter, seed=20)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, hidden, generator=g)
    experts = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(t)]).int()
    for bm in (2, 4):
        got_blocks = expert_blocks(experts.to(DEV), n_exp, bm)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got_blocks, expert_blocks_ref(experts, n_exp, bm)))
    monkeypatch.setattr(quant_moe, "MOE_BLOCKS", 1)
    got = quant_moe.moe_expert_pairs_quant(x.to(DEV), experts.to(DEV), *stacks)
    want = torch.stack([dense[2][e] @ (torch.nn.functional.silu(dense[0][e] @ x[p // top_k]) * (dense[1][e] @ x[p // top_k]))
                        for p, e in enumerate(experts.reshape(-1).tolist())])
    assert rel(got, want) < INT8_TOL
    fewer = quant_moe.moe_expert_pairs_quant(x[:t // 2].to(DEV), experts[:t // 2].to(DEV), *stacks)
    assert torch.equal(fewer, got[:t // 2 * top_k])


@pytest.mark.parametrize("qtype", KQUANTS)
def test_k_quant_kernels_refuse_ggml_order_blocks(qtype):
    """The kernels read K-quants only as interleaved int32 rows: ggml's bytes (the CPU reference's layout),
    an interleaved second stack next to a ggml first one, interleaved rows under another type, or
    activations in the other order are refused before launch; so is a shared-rows configuration past 4 rows."""
    from hf2q.kernels.quant import dequant_triton as quant_triton
    from hf2q.kernels.quant.dp4a_triton import matvec
    from hf2q.kernels.quant.int8_rows import Int8Rows

    raw = random_blocks(qtype, 4, 512)
    rows = to_gpu_rows(raw, qtype)
    with pytest.raises(ValueError, match="interleaved"):
        quant_triton.dequantize(raw, qtype, 4, 512, torch.empty(4, 512))
    xs = Int8Rows(torch.zeros(1, 128, dtype=torch.int32), torch.zeros(1, 32, 4), True)
    with pytest.raises(ValueError, match="interleaved"):
        matvec(xs, raw, qtype, 4, config=(4, 8, 1, 1))
    with pytest.raises(ValueError, match="interleaved"):
        matvec(xs, rows, qtype, 4, config=(4, 8, 1, 1), second=(raw, 4))
    with pytest.raises(ValueError, match="BLOCKED"):
        matvec(xs._replace(blocked=False), rows, qtype, 4, config=(4, 8, 1, 1))
    with pytest.raises(ValueError, match="shared-rows"):
        matvec(Int8Rows(torch.zeros(5, 128, dtype=torch.int32), torch.zeros(5, 32, 4), True), rows, qtype, 4,
               config=(4, 8, 1, 1, True))
    with pytest.raises(ValueError, match="uint8"):
        quant_triton.dequantize(rows, "Q8_0", 4, 512, torch.empty(4, 512))


@kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_kernels_misread_the_other_layout(qtype, monkeypatch):
    """Planted: with the layout check bypassed, ggml's blocks handed over as interleaved rows (zero-padded
    to one) come out wrong, so the equality tests above fail on a kernel that reads the wrong layout."""
    from hf2q.kernels.quant import dp4a_triton as quant_dp4a_triton, dequant_triton as quant_triton
    from hf2q.kernels.quant.ops import dequantize
    from hf2q.quant import gpu_row_words

    monkeypatch.setattr(quant_triton, "check_layout", lambda *a: None)
    monkeypatch.setattr(quant_dp4a_triton, "check_layout", lambda *a: None)
    raw = random_blocks(qtype, 9, 512, seed=5)
    want = dequantize_ref(raw, qtype, (9, 512))
    disguised = torch.nn.functional.pad(raw, (0, 4 * gpu_row_words(qtype, 512) - raw.shape[1])).view(torch.int32)
    x = int8_exact(torch.randn(1, 512, generator=torch.Generator().manual_seed(5)))
    for blocks, right in ((to_gpu_rows(raw, qtype).to(DEV), True), (disguised.to(DEV), False)):
        values = dequantize(blocks, qtype, (9, 512))
        product = quant_dp4a_triton.gemv(x.to(DEV), blocks, qtype, 9, config=(4, 2, 1, 1))
        errors = rel(values, want), rel(product, x.double() @ want.double().T)
        assert all(e < 1e-5 for e in errors) if right else not any(e < 0.1 for e in errors), errors  # NaN is wrong too


def _global_read_bytes(ptx: str) -> set[int]:
    """Sizes in bytes of the global-memory reads in PTX: loads to registers, and asynchronous copies to
    shared memory (pipelined configurations)."""
    sizes = set()
    for vec, bits in re.findall(r"ld\.global(?:\.[a-z]+)*?\.(?:v([248])\.)?[bsuf](8|16|32|64)\b", ptx):
        sizes.add(int(vec or 1) * int(bits) // 8)
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", ptx)
    sizes.update(int(n, 16) for n in copies)
    return sizes


@pytest.mark.parametrize("qtype,rows,stages", [(q, 1, 1) for q in QUANT_TYPES]
                         + [("Q4_K", 16, 1), ("Q6_K", 16, 1), ("Q5_K", "experts", 1), ("Q6_K", "experts", 1),
                            ("Q4_K", 1, 3), ("Q6_K", 1, 3), ("Q8_0", 1, 3), ("Q5_K+Q4_K", 1, 1), ("Q4_K+Q6_K", 1, 1),
                            ("Q4_K", 4, 1), ("Q6_K", 4, 1), ("Q5_K+Q4_K", 2, 1)])  # shared rows
def test_int8_matvec_compiles_for_hopper(qtype, rows, stages):
    """The mat-vec compiles to sm_90 machine code with dp4a (Triton's interpreter runs no PTX, and a
    construct only the compiler rejects, such as a non-constexpr global, would otherwise first show on a
    GPU). Q6_K rows are read in 32-bit words, the quants in 16-byte vectors: no 16-bit loads. With shared
    rows each word of nibbles is masked once for all BM rows in the PTX: BM dp4a a nibble mask (Q4_K 2·BM,
    its high nibbles masked apart), where units of one row each mask it again for every row."""
    from hf2q.kernels.quant import dp4a_triton as k

    experts = rows == "experts"
    qtype, qtype_b = (*qtype.split("+"), qtype)[:2]  # "A+B": two types in one launch
    config = next(c for c in k.candidates(qtype, 1 if experts else rows) if c[3] == stages)
    bn, sb, warps = config[:3]
    shared, even = len(config) > 4 and config[4], rows in (1, 4)
    sig = {"xq_ptr": "*i32", "act_ptr": "*fp32", "w16": "*i16", "w32": "*i32", "w16b": "*i16", "w32b": "*i32",
           "out_ptr": "*bf16", "expert_ptr": "*i32", "M": "i32", "N": "i32", "n_first": "i32", "row_units": "i32",
           "row_units_b": "i32", "n_units": "i32", "expert_units": "i32", "n_g16": "i32", "rows_per_x": "i32",
           "out_stride": "i32"}
    bm = 1 if experts else k._block_m(rows, None)
    kdim = 4096  # the sizes that follow from K are the kernel's constants
    const = dict(QTYPE=k.QTYPE_ID[qtype], QTYPE_B=k.QTYPE_ID[qtype_b], BM=bm, BN=bn, SB=sb, STAGES=stages,
                 HAS_EXPERTS=experts, TWO=experts or qtype_b != qtype, EVEN=even, EMULATE=False, SHARED=shared,
                 row_units=k._row_units(qtype, kdim), row_units_b=k._row_units(qtype_b, kdim),
                 n_units=kdim // k.block_layout(qtype)[0], n_g16=kdim // 16)
    sizes = ("N", "n_first", "expert_units", "out_stride")
    ptx = compile_for_hopper(k._gemv_dp4a_kernel, sig, const, warps, sizes if even else ())
    assert "dp4a" in ptx
    assert shared == (rows in (2, 4) and not experts), config  # the first candidate at 2-4 rows
    if qtype == "Q6_K":
        assert min(_global_read_bytes(ptx)) == 4 and 16 in _global_read_bytes(ptx)
    if {qtype, qtype_b} <= {"Q4_K", "Q5_K"} and even and stages == 1:  # unmasked: every field in 16-byte loads
        assert _global_read_bytes(ptx) == {16}, _global_read_bytes(ptx)
    if shared and qtype_b == qtype:
        dots, masks = len(re.findall(r"\bdp4a\.", ptx)), len(re.findall(r"and\.b32\s.*, 252645135;", ptx))
        assert dots == masks * bm * (2 if qtype == "Q4_K" else 1), (dots, masks)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_dequantize_compiles_for_hopper(qtype):
    """The prefill dequantization compiles to sm_90 machine code; interleaved Q6_K reads only 32-bit words."""
    from hf2q.kernels.quant import dequant_triton as qt

    sig = {"w8": "*u8", "w16": "*fp16", "w32": "*i32", "out_ptr": "*bf16", "N": "i32", "K": "i32",
           "row_stride": "i32", "nblk": "i32"}
    ptx = compile_for_hopper(qt._dequant_kernel, sig, dict(QTYPE=qt.QTYPE_ID[qtype], BLOCK_N=8), 4)
    sizes = _global_read_bytes(ptx)
    assert sizes
    if qtype == "Q6_K":
        assert min(sizes) == 4, sizes


@pytest.mark.parametrize("qtype,chunks,packed", [(q, 4, False) for q in QUANT_TYPES]
                         + [("Q4_K", 1, False), ("Q4_K", 1, True), ("Q6_K", 4, True)])
def test_quant_mm_compiles_for_hopper(qtype, chunks, packed):
    """The batched-decode kernel compiles to sm_90 machine code with tensor-core dots (mma), and makes the
    K-quants' fields floats without int-to-float conversions (an eighth of a float add's rate on Hopper): none for
    Q4_K and Q5_K, only Q6_K's signed scales (8 a tile), where the values and scales took 80 and 40. Packed, the
    values are made by fmas on bf16 pairs."""
    from hf2q.kernels.quant import mm_triton as mm

    sig = {"x_ptr": "*bf16", "w8": "*u8", "w16": "*fp16", "w32": "*i32", "out_ptr": "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "x_stride": "i32", "row_stride": "i32", "nblk": "i32", "tiles_per_split": "i32",
           "n_tiles": "i32"}
    const = dict(QTYPE=mm.QTYPE_ID[qtype], CHUNKS=chunks, BLOCK_N=32, IEEE=False, EVEN_K=True, PACKED=packed)
    ptx = compile_for_hopper(mm._quant_mm_kernel, sig, const, 8)
    assert "mma" in ptx
    assert (re.search(r"(fma\.rn|mul)\.bf16x2", ptx) is not None) == packed
    conversions = len(re.findall(r"cvt\.rn\.f32\.[us](?:8|16|32)\b", ptx))
    assert conversions == {"Q4_K": 0, "Q5_K": 0, "Q6_K": 8}.get(qtype, conversions), conversions


def test_q4k_columns_layout_dequantizes_to_ggml():
    """The column layout of the batched Q4_K kernel holds exactly ggml's values (codes, 6-bit scales and mins,
    d and dmin moved, nothing rounded), for weights of one and of several 256-value tiles."""
    from hf2q.kernels.quant import q4k_columns as qc

    for n, k in [(5, 256), (37, 768)]:
        raw = random_blocks("Q4_K", n, k, seed=n)
        cols = qc.from_blocks(raw, n)
        assert cols.shape == (n, k) and cols.codes.shape == (k // 8, n)
        assert torch.equal(qc.dequantize(cols), dequantize_ref(raw, "Q4_K", (n, k)))


@kernels
def test_q4k_columns_mm():
    """The batched Q4_K kernel on its column layout: 1 to 64 activation rows, weight rows not a multiple of the
    column block, K split over programs or not; each row's result is the same bitwise whatever the other rows."""
    from hf2q.kernels.quant import q4k_columns as qc

    n, k = 37, 768
    raw = random_blocks("Q4_K", n, k, seed=5)
    cols = qc.from_blocks(raw.to(DEV), n)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(7))
    want = x.double() @ dequantize_ref(raw, "Q4_K", (n, k)).double().T
    dtypes = (torch.float32, torch.bfloat16) if CUDA else (torch.float32,)
    for cfg in (None, (32, 4, 2, 1)):
        for dtype in dtypes:
            xd = x.to(DEV, dtype)
            full = qc.columns_mm(xd, cols, cfg)
            assert full.shape == (64, n) and full.dtype == dtype
            assert rel(full, want) < (1e-5 if dtype == torch.float32 else 1e-2), (cfg, dtype)
            for m in (1, 17, 33):
                assert torch.equal(qc.columns_mm(xd[:m].clone(), cols, cfg), full[:m]), (cfg, dtype, m)
    assert qc.config(n, k)[3] == 3  # few columns, long K: split


@pytest.mark.parametrize("chunks", [1, 4])
def test_q4k_columns_compiles_for_hopper(chunks):
    """The column kernel compiles to sm_90 machine code with tensor-core dots."""
    from hf2q.kernels.quant import q4k_columns as qc

    sig = {"x_ptr": "*bf16", "codes_ptr": "*i32", "scales_ptr": "*i16", "d_ptr": "*fp16", "dmin_ptr": "*fp16",
           "out_ptr": "*fp32", "M": "i32", "N": "i32", "stride_x": "i32", "tiles_per_split": "i32", "n_tiles": "i32"}
    assert "mma" in compile_for_hopper(qc._q4k_columns_kernel, sig, dict(BN=64, CHUNKS=chunks), 4)


@kernels
def test_kept_columns_serve_5_to_16_rows(monkeypatch):
    """`keep_columns` lays out a pack's Q4_K projections once (a mixed pack's Q4_K part, a lone projection its own);
    products of 5-16 rows (COLUMNS_ROWS) then read the column layout, whole pack or Q4_K part, fewer or more rows the
    blocks, with the blocks' products."""
    from hf2q.kernels.linear import ops as linear_ops
    from hf2q.kernels.quant import q4k_columns as qc
    from hf2q.layers.linear import Linear

    def kept(qtype, n, seed):
        lin, raw = Linear(256, n), random_blocks(qtype, n, 256, seed=seed)
        lin.set_quantized(kernel_blocks(raw, qtype), qtype)
        return lin, dequantize_ref(raw, qtype, (n, 256))

    (q, wq), (k, wk), (v, wv), (o, wo) = (kept(t, n, i) for i, (t, n) in
                                          enumerate([("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 16), ("Q4_K", 48)]))
    pack, whole = (q, k), torch.cat([wq, wk])
    linear_ops.pack(pack)
    assert linear_ops.keep_columns(pack) == linear_ops.keep_columns([o]) // 48 * 96
    mixed = (q, k, v)
    calls, real = [], qc.columns_mm
    monkeypatch.setattr(qc, "columns_mm", lambda x, c, *a: calls.append((x.shape[0], c.shape[0])) or real(x, c, *a))
    for rows, served in [(3, False), (5, True), (linear_ops.COLUMNS_ROWS, True), (linear_ops.COLUMNS_ROWS + 1, False)]:
        calls.clear()
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(DEV)
        for got, want in zip(linear_ops.packed_linear(x, pack), (wq, wk)):
            assert rel(got, x.cpu().double() @ want.double().T) < 2e-2
        assert rel(o(x), x.cpu().double() @ wo.double().T) < 2e-2
        assert calls == ([(rows, 96), (rows, 48)] if served else []), rows
        calls.clear()
        linear_ops.packed_linear(x, mixed)
        assert calls == ([(rows, 96)] if served else []), rows
