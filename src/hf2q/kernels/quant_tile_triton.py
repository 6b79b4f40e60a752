"""Triton kernel for a handful of rows (batched decode, 5–16 rows) times GGUF blocks, on tensor cores.

Each program dequantizes a tile of BLOCK_N weight rows once, one 256-value block at a time, and
multiplies it by BLOCK_M activation rows with tl.dot. The block is unpacked the way it is stored:
contiguous byte runs (16-byte loads), one scale per sub-block broadcast over its values, the two
nibble planes (or Q6_K's two nibble halves) as two 128-wide halves whose activations are loaded at the
matching positions. Nothing is gathered per value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q.kernels.quant_fields_triton import exact_f32, kquant_scale_min, u8
from hf2q.kernels.quant_gemv_triton import BLOCK_BYTES, BLOCK_ELEMS, QTYPE_ID


@triton.jit
def _dot(w, x, DOT_BF16: tl.constexpr):
    """w [BLOCK_N, K] · x [BLOCK_M, K]ᵀ in fp32; bf16 tensor cores on the device (the CPU interpreter
    mishandles bf16 dots, so it multiplies in fp32)."""
    if DOT_BF16:
        return tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)))
    return tl.dot(w, tl.trans(x), input_precision="ieee")


@triton.jit
def _x(x_rows, m_ok, offs, ok):
    """Activations [BLOCK_M, len(offs)] at value offsets `offs` (masked by `ok`)."""
    return tl.load(x_rows[:, None] + offs[None, :], mask=m_ok[:, None] & ok[None, :], other=0).to(tl.float32)


@triton.jit
def _kquant_tile(acc, w8, w16, x_rows, m_ok, row_base, row_ok, u, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_BF16: tl.constexpr):
    """Q4_K / Q5_K block u of every row: [BLOCK_N, 4 chunks, 32] bytes; low nibbles are sub-blocks 2c,
    high nibbles 2c + 1."""
    BB: tl.constexpr = 144 if QTYPE == 2 else 176
    QS: tl.constexpr = 16 if QTYPE == 2 else 48
    c = tl.arange(0, 4)
    l = tl.arange(0, 32)
    blk = row_base + u * BB  # [BN]
    m3 = row_ok[:, None, None]
    qs = u8(w8, blk[:, None, None] + (QS + 32 * c)[None, :, None] + l[None, None, :], m3)
    lo = qs & 15
    hi = qs >> 4
    if QTYPE == 3:
        qh = u8(w8, blk[:, None, None] + 16 + l[None, None, :], m3)
        lo += ((qh >> (2 * c)[None, :, None]) & 1) << 4
        hi += ((qh >> (2 * c + 1)[None, :, None]) & 1) << 4
    d = tl.load(w16 + blk // 2, mask=row_ok, other=0).to(tl.float32)[:, None, None]
    dmin = tl.load(w16 + blk // 2 + 1, mask=row_ok, other=0).to(tl.float32)[:, None, None]
    sc0, mn0 = kquant_scale_min(w8, blk[:, None], 2 * c, row_ok[:, None])
    sc1, mn1 = kquant_scale_min(w8, blk[:, None], 2 * c + 1, row_ok[:, None])
    w_lo = d * sc0[:, :, None] * exact_f32(lo, 0.0) - dmin * mn0[:, :, None]
    w_hi = d * sc1[:, :, None] * exact_f32(hi, 0.0) - dmin * mn1[:, :, None]
    xo = (u * 256 + 64 * c)[:, None] + l[None, :]  # [4, 32]: value 64c + l (low), + 32 (high)
    ok = tl.full((128,), 1, tl.int1)
    acc += _dot(tl.reshape(w_lo, (BLOCK_N, 128)), _x(x_rows, m_ok, tl.reshape(xo, (128,)), ok), DOT_BF16)
    acc += _dot(tl.reshape(w_hi, (BLOCK_N, 128)), _x(x_rows, m_ok, tl.reshape(xo + 32, (128,)), ok), DOT_BF16)
    return acc


@triton.jit
def _q6k_tile(acc, w8, w16, x_rows, m_ok, row_base, row_ok, u, BLOCK_N: tl.constexpr, DOT_BF16: tl.constexpr):
    """Q6_K block u of every row as two halves: the low and the high nibbles of its 128 ql bytes
    ([BLOCK_N, r = 2·half + j % 2, 32]), each with its 2-bit top from qh (see quant_gemv_triton._q6k_dots)."""
    r = tl.arange(0, 4)
    l = tl.arange(0, 32)
    g = tl.arange(0, 8)
    blk = row_base + u * 210
    m3 = row_ok[:, None, None]
    ql = u8(w8, blk[:, None, None] + (32 * r)[None, :, None] + l[None, None, :], m3)
    qh = u8(w8, blk[:, None, None] + (128 + 32 * (r // 2))[None, :, None] + l[None, None, :], m3)
    d = tl.load(w16 + (blk + 208) // 2, mask=row_ok, other=0).to(tl.float32)[:, None]
    ok = tl.full((128,), 1, tl.int1)
    for jhi in tl.static_range(2):
        j = 2 * jhi + r % 2
        val = ((ql >> (4 * jhi)) & 15) | (((qh >> (2 * j)[None, :, None]) & 3) << 4)
        # 16-value group g = 2r + l // 16 has scale 8·(g // 4) + 4·jhi + g % 4
        sc = tl.load(w8 + blk[:, None] + (192 + 8 * (g // 4) + 4 * jhi + g % 4)[None, :], mask=row_ok[:, None],
                     other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = tl.reshape(exact_f32(val, 32.0), (BLOCK_N, 8, 16)) * sc[:, :, None]
        xo = (u * 256 + 128 * (r // 2) + 32 * j)[:, None] + l[None, :]
        acc += _dot(tl.reshape(w, (BLOCK_N, 128)) * d, _x(x_rows, m_ok, tl.reshape(xo, (128,)), ok), DOT_BF16)
    return acc


@triton.jit
def _q8_q4_tile(acc, w8, w16, x_rows, m_ok, row_base, row_ok, t, n_units, QTYPE: tl.constexpr,
                BLOCK_N: tl.constexpr, DOT_BF16: tl.constexpr):
    """Eight 32-value blocks t·8 .. t·8+7 of every row (Q8_0: 32 int8; Q4_0: 16 bytes, value i is nibble
    i // 16 of byte i % 16, minus 8)."""
    b = t * 8 + tl.arange(0, 8)
    b_ok = b < n_units
    mask2 = row_ok[:, None] & b_ok[None, :]
    if QTYPE == 0:
        l = tl.arange(0, 32)
        blk = row_base[:, None] + (b * 34)[None, :]
        q = u8(w8, blk[:, :, None] + 2 + l[None, None, :], mask2[:, :, None])
        d = tl.load(w16 + blk // 2, mask=mask2, other=0).to(tl.float32)
        w = exact_f32(q ^ 128, 128.0) * d[:, :, None]
        xo = (b * 32)[:, None] + l[None, :]
        okx = tl.reshape(b_ok[:, None] & (l < 32)[None, :], (256,))
        acc += _dot(tl.reshape(w, (BLOCK_N, 256)), _x(x_rows, m_ok, tl.reshape(xo, (256,)), okx), DOT_BF16)
    else:
        l = tl.arange(0, 16)
        blk = row_base[:, None] + (b * 18)[None, :]
        q = u8(w8, blk[:, :, None] + 2 + l[None, None, :], mask2[:, :, None])
        d = tl.load(w16 + blk // 2, mask=mask2, other=0).to(tl.float32)[:, :, None]
        xo = (b * 32)[:, None] + l[None, :]
        okx = tl.reshape(b_ok[:, None] & (l < 16)[None, :], (128,))
        acc += _dot(tl.reshape(exact_f32(q & 15, 8.0) * d, (BLOCK_N, 128)),
                    _x(x_rows, m_ok, tl.reshape(xo, (128,)), okx), DOT_BF16)
        acc += _dot(tl.reshape(exact_f32(q >> 4, 8.0) * d, (BLOCK_N, 128)),
                    _x(x_rows, m_ok, tl.reshape(xo + 16, (128,)), okx), DOT_BF16)
    return acc


@triton.jit
def _tile_kernel(x_ptr, w8, w16, out_ptr, M, N, row_bytes, n_units, n_steps, x_stride, out_stride,
                 QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, DOT_BF16: tl.constexpr):
    """out[m, n] = Σ_k x[m, k] · W[n, k] for a tile of BLOCK_N weight rows and BLOCK_M activation rows."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_base = rows.to(tl.int64) * row_bytes
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M
    x_rows = x_ptr + ms.to(tl.int64) * x_stride
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(0, n_steps):
        if QTYPE == 4:
            acc = _q6k_tile(acc, w8, w16, x_rows, m_ok, row_base, row_ok, t, BLOCK_N, DOT_BF16)
        elif QTYPE >= 2:
            acc = _kquant_tile(acc, w8, w16, x_rows, m_ok, row_base, row_ok, t, QTYPE, BLOCK_N, DOT_BF16)
        else:
            acc = _q8_q4_tile(acc, w8, w16, x_rows, m_ok, row_base, row_ok, t, n_units, QTYPE, BLOCK_N, DOT_BF16)
    ptrs = out_ptr + ms[None, :].to(tl.int64) * out_stride + rows[:, None]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])


def tile_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: str, n: int, block_n: int = 16) -> torch.Tensor:
    """x [M, K] (M ≤ 16 is the intended use) times quantized rows raw [N, row_bytes] -> [M, N] in x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    n_units = k // BLOCK_ELEMS[qtype]
    rb = n_units * BLOCK_BYTES[qtype]
    n_steps = n_units if BLOCK_ELEMS[qtype] == 256 else triton.cdiv(n_units, 8)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    flat = raw.view(-1)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, 16))
    _tile_kernel[grid](x, flat, flat.view(torch.float16), out, m, n, rb, n_units, n_steps, x.stride(0),
                       out.stride(0), QTYPE=QTYPE_ID[qtype], BLOCK_N=block_n, BLOCK_M=16, DOT_BF16=x.is_cuda,
                       num_warps=4)
    return out
