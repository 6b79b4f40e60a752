"""Triton mat-vec for GGUF blocks on 8-bit integer dot products (dp4a), for decode's few rows.

A float mat-vec spends a dozen instructions per weight unpacking, converting and multiplying. Here the
activation rows are first quantized to int8 in 32-value groups (scale dx = max|x| / 127, as llama.cpp's
q8_1), then each 32-bit word of weights is unpacked to four bytes with a mask and a shift and
multiplied against four activation bytes by one dp4a instruction; the words of a (sub-)block's part
are chained through dp4a's accumulator, so no sum crosses threads inside the loop. Each part's integer
sum is scaled once (d · scale · dx). Values are centred on their range's middle (Q4_K 8, Q5_K 16,
Q6_K 32, Q4_0 8) through the quantized group's sum, and K-quant mins and the centring of K-quants use
the activations' exact float sums. The only rounding beyond fp32 accumulation is the activations'
int8 quantization (about 0.5% relative per dot product; tests/quant/test_kernels.py states the
tolerances).

K-quants (Q4_K, Q5_K, Q6_K): a thread owns whole (activation row, weight row, block) units and walks
its block in static loops, so every shift that picks a scale, a min or a bit field is a constant.
Neighbouring threads own neighbouring blocks, and the GPU keeps K-quant rows interleaved by 16-byte
quads (hf2q.quant.to_gpu_rows), with the activations in the same order (BLOCKED, store_int8_groups):
each 16-byte load of a warp then reads consecutive bytes, where ggml's order would spread it over 32
cache lines and stall on L1 throughput.
Q8_0 and Q4_0: a thread owns 16-value parts, and BLOCK_M activation rows share each unpacked weight
word; their blocks follow ggml's structs byte for byte and are only 2-byte aligned, so their words
are joined from two 16-bit halves. With `experts`, every row m has its own expert's weight (MoE
token-expert pairs) and BLOCK_M is 1.
"""
from __future__ import annotations

import collections
import os
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hf2q import envs
from hf2q.kernels.tuning import pdl, cache as tune_cache
from hf2q.kernels.quant.fields_triton import f16_bits
from hf2q.kernels.quant.dequant_triton import QTYPE_ID, check_layout
from hf2q.kernels.tuning.timing import cold_copies, graph_time_us
from hf2q.quant import KQUANTS, block_layout, gpu_row_words

EMULATE = envs.triton_interpret()  # the interpreter runs no PTX: dp4a in plain integer ops
NIBBLES = tl.constexpr(0x0F0F0F0F)
HIGH_NIBBLES = tl.constexpr(-0x0F0F0F10)  # 0xF0F0F0F0 as int32


@triton.jit
def int8_groups(x, GROUPS: tl.constexpr):
    """x fp32 [GROUPS, 32] -> int8 values q (as fp32) with dx = max|x| / 127 per group [GROUPS, 1], dx·Σq
    per 16-value half [GROUPS, 2], and per group Σx - dx·Σq and Σx [GROUPS, 1]."""
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    v = x * inv[:, None]
    q = tl.minimum(tl.maximum(tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)), -127.0), 127.0)
    dx = (amax / 127.0)[:, None]
    sq = dx * tl.sum(tl.reshape(q, (GROUPS, 2, 16)), axis=2)
    sx = tl.sum(x, axis=1)[:, None]
    fix = sx - tl.sum(sq, axis=1)[:, None]
    return q, dx, sq, fix, sx


@triton.jit
def store_int8_groups(xq_ptr, act_ptr, row, n_groups, g, ok, q, dx, sq, fix, sx, GROUPS: tl.constexpr,
                      BLOCKED: tl.constexpr):
    """Write int8_groups' results for groups g [GROUPS] of activation row `row` (n_groups groups a row
    apart: row is the row's first group index): the int8 values, and per 16-value piece the quad
    (dx, dx·Σxq of the piece, Σx - dx·Σxq of the group, Σx of the group). Pieces go in the row's
    order, or BLOCKED (for the K-quant kernels, n_groups a multiple of 8): piece j of 256-value block u
    at j·B + u of B blocks, the order of interleaved weight rows (hf2q.quant.to_gpu_rows)."""
    h = tl.arange(0, 2)
    piece = 2 * g[:, None] + h[None, :]  # [GROUPS, 2]
    if BLOCKED:
        piece = (piece % 16) * (n_groups // 8) + piece // 16
    quad = 2 * row + piece
    l = tl.arange(0, 16)
    tl.store(xq_ptr + quad[:, :, None] * 16 + l[None, None, :], tl.reshape(q, (GROUPS, 2, 16)).to(tl.int8),
             mask=ok[:, None, None])
    base = act_ptr + quad * 4
    hok = ok[:, None] & (h < 2)[None, :]
    tl.store(base, tl.broadcast_to(dx, (GROUPS, 2)), mask=hok)
    tl.store(base + 1, sq, mask=hok)
    tl.store(base + 2, tl.broadcast_to(fix, (GROUPS, 2)), mask=hok)
    tl.store(base + 3, tl.broadcast_to(sx, (GROUPS, 2)), mask=hok)


@triton.jit
def quantize_and_store(xq_ptr, act_ptr, y, row, first, n_groups, BLOCK: tl.constexpr, BLOCKED: tl.constexpr):
    """For a kernel that has just produced y [BLOCK], values first·32 .. of activation row `row` (of
    n_groups groups): write their int8 groups as quantize_rows would (groups past n_groups skipped)."""
    G: tl.constexpr = BLOCK // 32
    g = first + tl.arange(0, G)
    q, dx, sq, fix, sx = int8_groups(tl.reshape(y.to(tl.float32), (G, 32)), G)
    store_int8_groups(xq_ptr, act_ptr, row * n_groups, n_groups, g, g < n_groups, q, dx, sq, fix, sx, G, BLOCKED)


# Columns of a row one program quantizes where a kernel writes int8 rows beside its output (the norm,
# SwiGLU): quantizing a 4096-wide row in one program (one SM) took longer than the norm itself.
QUANT_SLICE = 512


@triton.jit
def _quantize_kernel(x_ptr, xq_ptr, act_ptr, n_groups, x_stride, GROUPS: tl.constexpr, BLOCKED: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Row m, 32-value groups g: xq = round(x / dx) in int8 with dx = max|x| / 127, and per 16-value half
    the four floats (store_int8_groups) that the mat-vec's offset and min terms need."""
    pdl.enter(PDL)
    m = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    l = tl.arange(0, 32)
    ok = g < n_groups
    x = tl.load(x_ptr + m * x_stride + g[:, None] * 32 + l[None, :], mask=ok[:, None], other=0).to(tl.float32)
    q, dx, sq, fix, sx = int8_groups(x, GROUPS)
    store_int8_groups(xq_ptr, act_ptr, m.to(tl.int64) * n_groups, n_groups, g, ok, q, dx, sq, fix, sx, GROUPS,
                      BLOCKED)


@triton.jit
def _below(i, n, ALWAYS: tl.constexpr):
    """i < n, known true at compile time when ALWAYS (the launch's sizes are multiples of the tiles): masks
    that fold away leave plain loads, without the predicates and zeroed registers of masked ones."""
    if ALWAYS:
        return i == i
    return i < n


@triton.jit
def _dp4a_emulated(a, b, SIGNED: tl.constexpr):
    """Σ of the four byte products of int32 words a and b in plain integer ops (the interpreter runs no PTX)."""
    acc = (a & 0) + (b & 0)
    for i in tl.static_range(4):
        bi = (b << (24 - 8 * i)) >> 24
        if SIGNED:
            ai = (a << (24 - 8 * i)) >> 24
        else:
            ai = (a >> (8 * i)) & 255
        acc += ai * bi
    return acc


@triton.jit
def _dp4a_acc(a, b, c, SIGNED: tl.constexpr, EMULATE: tl.constexpr):
    """c + Σ of the four byte products of int32 words a and b (b's bytes signed; a's signed if SIGNED).
    Dots are chained through c word by word, so no sum ever crosses threads."""
    if EMULATE:
        return c + _dp4a_emulated(a, b, SIGNED)
    a, b = tl.broadcast(a, b)
    a, c = tl.broadcast(a, c)
    if SIGNED:
        asm: tl.constexpr = "dp4a.s32.s32 $0, $1, $2, $3;"
    else:
        asm: tl.constexpr = "dp4a.u32.s32 $0, $1, $2, $3;"
    return tl.inline_asm_elementwise(asm, "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _word_from_halves(w16, half, mask):
    """int32 words whose two 16-bit halves are at w16 + half and w16 + half + 1 (2-byte-aligned blocks)."""
    lo = tl.load(w16 + half, mask=mask, other=0).to(tl.int32) & 0xFFFF
    hi = tl.load(w16 + half + 1, mask=mask, other=0).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def _half_quads(w16, half, mask):
    """The four consecutive int32 words at 16-bit offset `half` [A, B] (2-byte-aligned blocks), as four [A, B]."""
    return (_word_from_halves(w16, half, mask), _word_from_halves(w16, half + 2, mask),
            _word_from_halves(w16, half + 4, mask), _word_from_halves(w16, half + 6, mask))


@triton.jit
def _quads(ptr, off, mask):
    """The four consecutive 32-bit values at ptr + off [A, B] (16-byte aligned), as four [A, B]: one
    16-byte load per element, split in registers (no layout change: the four stay in one thread)."""
    v = tl.load(ptr + off[:, :, None] + tl.arange(0, 4)[None, None, :], mask=mask[:, :, None], other=0)
    ab, cd = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], 2, 2)))  # components (0, 2) and (1, 3)
    v0, v2 = tl.split(ab)
    v1, v3 = tl.split(cd)
    return v0, v1, v2, v3


@triton.jit
def _quads3(ptr, off, mask):
    """_quads for offsets [A, B, C]: four [A, B, C]."""
    v = tl.load(ptr + off[:, :, :, None] + tl.arange(0, 4)[None, None, None, :], mask=mask[:, :, :, None], other=0)
    ab, cd = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], v.shape[2], 2, 2)))
    v0, v2 = tl.split(ab)
    v1, v3 = tl.split(cd)
    return v0, v1, v2, v3


@triton.jit
def _unit_grid(x_g16, m_ok, row_q, row_ok, u, n_units, EVEN: tl.constexpr):
    """The K-quant kernels' (activation row, weight row, block) units as [BM, BN, SB] tensors, one layout for
    every tensor so that nothing is shuffled between threads: the units' mask, their blocks' first quad
    in the interleaved weight rows (quad q of the block is n_units·q further), and their first 16-value
    piece in the BLOCKED activations (piece j likewise n_units·j further; the int8 values and the
    activation table both hold one quad per piece, so one index serves both)."""
    mask = (m_ok[:, None, None] & row_ok[None, :, None]) & _below(u, n_units, EVEN)[None, None, :]
    w0 = (x_g16 * 0)[:, None, None] + row_q[None, :, None] + u[None, None, :]
    x0 = x_g16[:, None, None] + (row_q * 0)[None, :, None] + u[None, None, :]
    return mask, w0, x0


@triton.jit
def _kquant_q45(w32, xq32, act, x_g16, m_ok, row_q, row_ok, u0, n_units, QTYPE: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, SB: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr):
    """Q4_K / Q5_K blocks u0 .. u0+SB of interleaved rows: W·x per (row, block) [BM, BN, SB], summed by the
    caller. A block's quads: header (f16 d, f16 dmin, 12 scale bytes), for Q5_K two of fifth bits, then 8
    of nibbles. A thread walks its block's four 64-value chunks c in a static loop: chunk c's 8 quant
    words hold sub-block 2c in their low nibbles and sub-block 2c + 1 in their high ones, so every shift
    that picks a scale, a min or a fifth bit is a constant, and each sub-block's scale and activation
    sums are applied once."""
    QS: tl.constexpr = 1 if QTYPE == 2 else 3  # first quad of nibbles
    OFF: tl.constexpr = 8 if QTYPE == 2 else 16  # middle of the value range
    u = u0 + tl.arange(0, SB)
    mask, w0, x0 = _unit_grid(x_g16, m_ok, row_q, row_ok, u, n_units, EVEN)
    head, wa, wb, wh = _quads3(w32, 4 * w0, mask)  # d | dmin, then scale bytes 0-3, 4-7, 8-11
    d = f16_bits(head)
    dmin = f16_bits(head >> 16)
    if QTYPE == 3:
        qh_a = _quads3(w32, 4 * (w0 + n_units), mask)
        qh_b = _quads3(w32, 4 * (w0 + 2 * n_units), mask)
    part = tl.zeros((BM, BN, SB), dtype=tl.float32)
    for c in tl.static_range(4):
        acc_lo = tl.zeros((BM, BN, SB), dtype=tl.int32)
        acc_hi = tl.zeros((BM, BN, SB), dtype=tl.int32)
        for half in tl.static_range(2):
            w_quad = _quads3(w32, 4 * (w0 + (QS + 2 * c + half) * n_units), mask)
            xlo_quad = _quads3(xq32, 4 * (x0 + (4 * c + half) * n_units), mask)
            xhi_quad = _quads3(xq32, 4 * (x0 + (4 * c + 2 + half) * n_units), mask)
            for i in tl.static_range(4):
                words = w_quad[i]
                lo = words & NIBBLES
                if QTYPE == 2:  # high nibbles left in place: bytes 16·q, the sum scaled by 1/16 below
                    hi = words & HIGH_NIBBLES
                else:  # fifth bits: bit 2c (low) and 2c + 1 (high) of qh byte l
                    qh = qh_a[i] if half == 0 else qh_b[i]
                    hi = ((words >> 4) & NIBBLES) | (((qh >> (2 * c + 1)) & 0x01010101) << 4)
                    lo |= ((qh >> (2 * c)) & 0x01010101) << 4
                acc_lo = _dp4a_acc(lo, xlo_quad[i], acc_lo, False, EMULATE)
                acc_hi = _dp4a_acc(hi, xhi_quad[i], acc_hi, False, EMULATE)
        for nib in tl.static_range(2):  # sub-block s = 2c + nib: ggml's get_scale_min_k4, constant shifts
            if 2 * c + nib < 4:
                sc = (wa >> (16 * c + 8 * nib)) & 63
                mn = (wb >> (16 * c + 8 * nib)) & 63
            else:  # byte i = s - 4 of the last four holds the low bits, bits 6-7 of bytes i and 4 + i the top
                sc = ((wh >> (16 * c + 8 * nib - 32)) & 15) | (((wa >> (16 * c + 8 * nib - 26)) & 3) << 4)
                mn = ((wh >> (16 * c + 8 * nib - 28)) & 15) | (((wb >> (16 * c + 8 * nib - 26)) & 3) << 4)
            if nib == 0:
                dot = acc_lo.to(tl.float32)
            elif QTYPE == 2:
                dot = acc_hi.to(tl.float32) * 0.0625
            else:
                dot = acc_hi.to(tl.float32)
            # the sub-block's activation group: its first piece's table entry
            dx, _, fix, sx = _quads3(act, 4 * (x0 + (4 * c + 2 * nib) * n_units), mask)
            # Σ q·x = dx·Σ (q - OFF)·xq + OFF·(Σx - dx·Σxq): centring the values halves the part the int8
            # rounding touches, and Σx is exact.
            part += d * sc.to(tl.float32) * (dx * dot + OFF * fix) - dmin * mn.to(tl.float32) * sx
    return part


@triton.jit
def _q6k(w32, xq32, act, x_g16, m_ok, row_q, row_ok, u0, n_units, BM: tl.constexpr, BN: tl.constexpr,
         SB: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr):
    """Q6_K blocks u0 .. u0+SB of interleaved rows (hf2q.quant.to_gpu_rows): W·x per (row, block)
    [BM, BN, SB]. A block's quads: 8 of low nibbles (ql), 4 of 2-bit tops (qh), one of 16 int8 scales
    (one per 16 values); every block's f16 d follows in a plane of its own. Value 128h + 32j + l of a
    block has its low nibble in ql byte 64h + 32(j % 2) + l, shifted by 4(j // 2), and its top bits in
    qh byte 32h + l, shifted by 2j. A thread walks its block's 16-value pieces (h, j, half of l) in
    static loops, so every shift is a constant and each word of nibbles and tops is read once. Values
    are stored + 32."""
    u = u0 + tl.arange(0, SB)
    mask, w0, x0 = _unit_grid(x_g16, m_ok, row_q, row_ok, u, n_units, EVEN)
    d_word = tl.load(w32 + 4 * (w0 - u[None, None, :]) + 52 * n_units + (u // 2)[None, None, :], mask=mask, other=0)
    d = f16_bits(d_word >> (16 * (u % 2))[None, None, :])
    scales = _quads3(w32, 4 * (w0 + 12 * n_units), mask)  # word 2h + j // 2: bytes 2(j % 2) + half
    part = tl.zeros((BM, BN, SB), dtype=tl.float32)
    for h in tl.static_range(2):
        qh0 = _quads3(w32, 4 * (w0 + (8 + 2 * h) * n_units), mask)
        qh1 = _quads3(w32, 4 * (w0 + (9 + 2 * h) * n_units), mask)
        for jlo in tl.static_range(2):
            ql0 = _quads3(w32, 4 * (w0 + (4 * h + 2 * jlo) * n_units), mask)
            ql1 = _quads3(w32, 4 * (w0 + (4 * h + 2 * jlo + 1) * n_units), mask)
            for jhi in tl.static_range(2):
                for hf in tl.static_range(2):
                    piece = x0 + (8 * h + 2 * (2 * jhi + jlo) + hf) * n_units
                    x_quad = _quads3(xq32, 4 * piece, mask)
                    dot = tl.zeros((BM, BN, SB), dtype=tl.int32)
                    for i in tl.static_range(4):
                        low = ql0[i] if hf == 0 else ql1[i]
                        top = qh0[i] if hf == 0 else qh1[i]
                        vals = ((low >> (4 * jhi)) & NIBBLES) | (((top >> (2 * (2 * jhi + jlo))) & 0x03030303) << 4)
                        dot = _dp4a_acc(vals, x_quad[i], dot, False, EMULATE)
                    dx, sq, _, _ = _quads3(act, 4 * piece, mask)
                    sc = ((scales[2 * h + jhi] << (24 - 8 * (2 * jlo + hf))) >> 24).to(tl.float32)
                    part += sc * (dx * dot.to(tl.float32) - 32 * sq)
    return part * d


@triton.jit
def _act(act, g16, mask):
    """(dx, dx·Σxq of the piece, Σx - dx·Σxq of the 32-value group, Σx of the group) of 16-value pieces
    g16 [BM, Q] (in the rows' order), each [BM, 1, Q]."""
    dx, sq, fix, sx = _quads(act, g16 * 4, mask)
    return dx[:, None, :], sq[:, None, :], fix[:, None, :], sx[:, None, :]


@triton.jit
def _q8_q4(w16, xq32, act, x_g16, m_ok, row_h, row_ok, u0, n_units, QTYPE: tl.constexpr, BM: tl.constexpr,
           BN: tl.constexpr, SB: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr):
    """32-value blocks u0 .. u0+SB: Q8_0 (f16 d, 32 int8) or Q4_0 (f16 d, 16 bytes: value i is nibble
    i // 16 of byte i % 16, stored + 8). W·x per (row, part) [BM, BN, SB·2] (Q8_0: halves of a block;
    Q4_0: blocks, the second of each pair of parts empty)."""
    HB: tl.constexpr = 17 if QTYPE == 0 else 9  # block size in 16-bit halves
    q = tl.arange(0, SB * 2)
    u = u0 + q // 2
    hf = q % 2
    if QTYPE == 0:
        u_ok = _below(u, n_units, EVEN)
    else:  # Q4_0's four words make one part
        u_ok = _below(u, n_units, EVEN) & (hf == 0)
    mask2 = row_ok[:, None] & u_ok[None, :]
    blk = row_h[:, None] + (u * HB)[None, :]  # [BN, Q]
    xmask = m_ok[:, None] & u_ok[None, :]
    xw = x_g16[:, None] * 4 + (8 * u + 4 * hf)[None, :]
    qw = blk + (1 + 8 * hf)[None, :]
    dot = tl.zeros((BM, BN, SB * 2), dtype=tl.int32)
    x0 = _quads(xq32, xw, xmask)
    if QTYPE == 1:
        x1 = _quads(xq32, xw + 4, xmask)
    w_quad = _half_quads(w16, qw, mask2)
    for i in tl.static_range(4):
        words = w_quad[i]
        if QTYPE == 0:
            dot = _dp4a_acc(words[None, :, :], x0[i][:, None, :], dot, True, EMULATE)
        else:
            dot = _dp4a_acc((words & NIBBLES)[None, :, :], x0[i][:, None, :], dot, False, EMULATE)
            dot = _dp4a_acc(((words >> 4) & NIBBLES)[None, :, :], x1[i][:, None, :], dot, False, EMULATE)
    dx, sq, _, _ = _act(act, x_g16[:, None] + (2 * u + hf)[None, :], xmask)
    d = tl.load(w16 + blk, mask=mask2, other=0).to(tl.float16, bitcast=True).to(tl.float32)[None, :, :]
    if QTYPE == 0:
        return d * dx * dot.to(tl.float32)
    _, sq1, _, _ = _act(act, x_g16[:, None] + (2 * u + 1)[None, :], xmask)
    return d * (dx * dot.to(tl.float32) - 8 * (sq + sq1))


@triton.jit
def _row_products(w16, w32, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, n_units, QTYPE: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr,
                  EMULATE: tl.constexpr):
    """The blocks of BN weight rows (of type QTYPE, from row_base) times BM activation rows, walked SB
    blocks a step: parts [BM, BN, PARTS] summed elementwise, reduced by the caller."""
    PARTS: tl.constexpr = SB * 2 if QTYPE <= 1 else SB
    acc = tl.zeros((BM, BN, PARTS), dtype=tl.float32)
    for u0 in tl.range(0, n_units, SB, num_stages=STAGES):
        if QTYPE == 2 or QTYPE == 3:
            acc += _kquant_q45(w32, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, u0, n_units, QTYPE, BM, BN, SB,
                               EVEN, EMULATE)
        elif QTYPE == 4:
            acc += _q6k(w32, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, u0, n_units, BM, BN, SB, EVEN, EMULATE)
        else:
            acc += _q8_q4(w16, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, u0, n_units, QTYPE, BM, BN, SB, EVEN,
                          EMULATE)
    return acc


@triton.jit
def _gemv_dp4a_kernel(xq_ptr, act_ptr, w16, w32, w16b, w32b, out_ptr, expert_ptr, M, N, n_first, row_units,
                      row_units_b, n_units, expert_units, n_g16, rows_per_x, out_stride, QTYPE: tl.constexpr,
                      QTYPE_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr,
                      STAGES: tl.constexpr, HAS_EXPERTS: tl.constexpr, TWO: tl.constexpr, EVEN: tl.constexpr,
                      EMULATE: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, n] = Σ_k x[m, k] · W[n, k] for BM activation rows and BN weight rows per program. Row
    strides come in the unit the type's blocks are read in (16-byte quads for the interleaved K-quant
    rows, else halves), so that the compiler sees their alignment. Parts are summed elementwise; one
    reduction at the end. STAGES > 1 lets the compiler copy the next steps' weights asynchronously while
    this one computes (more bytes in flight per SM, paid for in registers and shared memory). TWO: output
    columns from n_first on come from a second weight (an MoE's gate and up stacks, or a layer's
    projections of one input kept in two types, in one launch; n_first is a multiple of BN), of type
    QTYPE_B and row stride row_units_b. Output row m multiplies activation row m // rows_per_x. EVEN: M,
    N and the blocks a row are multiples of BM, BN and SB, so nothing is masked. PDL (kernels/tuning/pdl.py): the
    program waits for the previous kernel before its first read, and lets the next kernel start once its
    loop is done."""
    ms = tl.program_id(1) * BM + tl.arange(0, BM)
    m_ok = _below(ms, M, EVEN)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)  # axis 0: a vocabulary's rows outnumber axis 1's limit
    row_ok = _below(cols, N, EVEN)
    x_g16 = (ms // rows_per_x).to(tl.int64) * n_g16  # first 16-value piece of each activation row
    pdl.wait_prior(PDL)
    expert_base = 0
    if HAS_EXPERTS:
        expert_base = tl.load(expert_ptr + tl.program_id(1)).to(tl.int64) * expert_units
    second = TWO and tl.program_id(0) * BN >= n_first
    if QTYPE_B == QTYPE:  # one body: the second weight's programs only swap pointers
        rows = cols
        if second:
            w16, w32, rows, row_units = w16b, w32b, cols - n_first, row_units_b
        row_base = rows.to(tl.int64) * row_units + expert_base
        acc = _row_products(w16, w32, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, n_units, QTYPE, BM, BN, SB,
                            STAGES, EVEN, EMULATE)
    elif second:
        row_base = (cols - n_first).to(tl.int64) * row_units_b + expert_base
        acc = _row_products(w16b, w32b, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, n_units, QTYPE_B, BM, BN,
                            SB, STAGES, EVEN, EMULATE)
    else:
        row_base = cols.to(tl.int64) * row_units + expert_base
        acc = _row_products(w16, w32, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, n_units, QTYPE, BM, BN, SB,
                            STAGES, EVEN, EMULATE)
    pdl.release_next(PDL)
    out = out_ptr + ms.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, tl.sum(acc, axis=2).to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


class Int8Rows(NamedTuple):
    """Activation rows as the mat-vec reads them: int8 values as int32 words [M, K/4], float32 [M, K/16, 4]
    per 16-value piece (dx, dx·Σxq of the piece, Σx - dx·Σxq and Σx of its 32-value group), and whether
    the pieces are in BLOCKED order (store_int8_groups) for K-quant weights, or in the row's order."""
    xq: torch.Tensor
    act: torch.Tensor
    blocked: bool


def blocked_for(qtype: str) -> bool:
    """Whether weights of `qtype` read activations in BLOCKED order (the interleaved K-quant rows)."""
    return qtype in KQUANTS


def int8_writes(int8_for: str | None, width: int) -> tuple[bool, bool]:
    """(write, BLOCKED) for a kernel whose width-wide rows feed the int8 mat-vec of a weight of type
    `int8_for` (None: no such reader): it writes int8 rows only in whole 32-value groups, and BLOCKED
    ones only in whole 256-value blocks."""
    blocked = int8_for is not None and blocked_for(int8_for)
    return int8_for is not None and width % (256 if blocked else 32) == 0, blocked


def quantize_rows(x: torch.Tensor, key: torch.Tensor | None = None, blocked: bool = False) -> Int8Rows:
    """x [M, K] (K a multiple of 32; of 256 when blocked) -> its Int8Rows, in BLOCKED order if `blocked`.

    The last few inputs' results are kept: projections of one input in several packs (a DeltaNet's Q5_K
    qkv and Q4_K z/a/b; an MoE's shared expert and routed experts, whose SwiGLU outputs are quantized in
    between) quantize it once. The same tensor object (`key`, the tensor x is a reshaped view of, else x),
    unmodified since (its version counter), is the only hit (see _stamp for tensors made under inference
    mode)."""
    key = x if key is None else key
    for ref, stamp, out in _RECENT:
        if ref() is key and stamp == _stamp(key) and out.xq.shape[0] == x.shape[0] and out.blocked == blocked:
            return out
    xc = x.contiguous()
    m, k = xc.shape
    groups = k // 32
    if blocked and k % 256:
        raise ValueError(f"BLOCKED int8 rows need a multiple of 256 values, not {k}")
    xq, act = int8_buffers(m, k, x.device)
    _quantize_kernel[(m, triton.cdiv(groups, 16))](xc, xq, act, groups, xc.stride(0), GROUPS=16, BLOCKED=blocked,
                                                     **pdl.launch_options(x.device))
    out = Int8Rows(xq.view(torch.int32), act, blocked)
    _RECENT.appendleft((weakref.ref(key), _stamp(key), out))
    return out


_RECENT: collections.deque = collections.deque(maxlen=4)  # (weakref to the input, its stamp, Int8Rows)


def _stamp(t: torch.Tensor):
    """What tells a cached quantization of t from a stale one: t's version counter, bumped by every
    in-place write. Tensors made under inference mode have none (torch does not track them); for those
    the object's identity is the whole key, which holds because a projection's input is never written in
    place after it is produced (norm, SwiGLU and mixer outputs are fresh tensors each step)."""
    return None if t.is_inference() else t._version


def int8_buffers(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (xq int8 [M, K], act float32 [M, K/16, 4]) for a kernel that quantizes rows as it writes them."""
    return (torch.empty(m, k, dtype=torch.int8, device=device),
            torch.empty(m, k // 16, 4, dtype=torch.float32, device=device))


def remember(x: torch.Tensor, xq: torch.Tensor, act: torch.Tensor, blocked: bool) -> None:
    """Record (xq, act) as x's quantization (written by a kernel that produced x), for quantize_rows."""
    _RECENT.appendleft((weakref.ref(x), _stamp(x), Int8Rows(xq.view(torch.int32), act, blocked)))


# (BLOCK_N, blocks per step, warps, stages) candidates, most work per thread first: a mat-vec is fed by
# the bytes each thread has in flight.
# Q8_0 / Q4_0: those that would give a thread more than MAX_PARTS (row, part) sums of BLOCK_M activation
# rows spill registers and are left out (see candidates).
_B_CANDIDATES = [(4, 16, 1, 1), (8, 16, 2, 1), (4, 32, 1, 1), (8, 32, 2, 1), (4, 16, 4, 1), (16, 16, 4, 1),
                 (8, 4, 4, 1), (4, 8, 4, 1), (4, 4, 4, 1), (1, 64, 2, 1), (1, 128, 4, 1), (2, 64, 4, 1),
                 (4, 16, 1, 3), (8, 16, 2, 3), (8, 4, 4, 3)]
# K-quants: a thread holds whole (activation row, weight row, block) units (_kquant_q45, _q6k), at least
# one (no thread repeats another's work) and at most MAX_UNITS. Steps of 16 blocks cover a 4096-wide row,
# of 8 a 2048-wide one, of 2 an expert's 512-wide down projection.
_K_CANDIDATES = [(2, 16, 1, 1), (4, 8, 1, 1), (4, 16, 2, 1), (8, 8, 2, 1), (8, 16, 4, 1), (16, 8, 4, 1),
                 (4, 16, 1, 1), (8, 8, 1, 1), (16, 2, 1, 1), (32, 2, 2, 1), (16, 4, 2, 1),
                 (2, 4, 1, 1), (4, 2, 1, 1), (2, 8, 2, 1), (4, 8, 4, 1), (2, 16, 1, 3), (4, 8, 1, 3)]
MAX_PARTS = 16
MAX_UNITS = 4


class TuneKey(NamedTuple):
    """What a timed configuration is picked for: type, output rows (and a second weight's), K, activation
    rows or token-expert pairs rounded up to a power of two, and whether the weight is an expert stack."""
    qtype: str
    n: int
    n2: int
    k: int
    rows: int
    experts: bool


_TUNED: dict[TuneKey, tuple] = {}
_TUNE = envs.gemv_tune()


def candidates(qtype: str, rows: int = 1) -> list[tuple[int, int, int, int]]:
    """Configurations for `rows` activation rows (their BLOCK_M), default first."""
    bm = _block_m(rows, None)
    if qtype in ("Q8_0", "Q4_0"):
        fit = [c for c in _B_CANDIDATES if bm * c[0] * c[1] * 2 <= MAX_PARTS * 32 * c[2]]
        return fit or [min(_B_CANDIDATES, key=lambda c: c[0] * c[1] / c[2])]
    fit = [c for c in _K_CANDIDATES if 32 * c[2] <= bm * c[0] * c[1] <= MAX_UNITS * 32 * c[2]]
    return fit or [min(_K_CANDIDATES, key=lambda c: c[0] * c[1] / c[2])]


def _block_m(m: int, experts) -> int:
    return 1 if experts is not None else min(16, 1 << (m - 1).bit_length())


def best_config(xs, raw, qtype: str, n: int, experts, second=None, rows_per_x: int = 1) -> tuple[int, int, int, int]:
    """The fastest candidate for this shape, timed once per (type, N, K, rows rounded up to a power of two,
    experts) on CUDA outside graph capture (a capture's warm-up step does it); the first candidate inside
    a capture or with HF2Q_GEMV_TUNE=0; under Triton's interpreter, which pays per program, the one with
    the most rows a program. A choice stored by an earlier start on the same card (kernels/tuning/cache.py)
    is taken without timing. Timed from graph replays over copies of the
    weight that overflow L2 (kernels/tuning/timing.py): eager launches of a 10 µs kernel measure the host's
    launch rate, and a weight left in L2 by the previous call favours configurations that need a warm
    cache. (An expert stack is one copy: its few chosen experts stay warm.)"""
    xq = xs[0]

    def fits(c):  # two weights in one launch: the first's rows are whole programs
        return not second or n % c[0] == 0

    if not xq.is_cuda:  # no registers to spill: any candidate
        every = _B_CANDIDATES if qtype in ("Q8_0", "Q4_0") else _K_CANDIDATES
        return max(filter(fits, every), key=lambda c: (c[0], c[1]))
    ok = list(filter(fits, candidates(qtype, 1 if experts is not None else xq.shape[0])))
    if not _TUNE:
        return ok[0]
    pairs = xq.shape[0] * rows_per_x if experts is None else len(experts)
    qtype2 = _second_type(second, qtype)
    key = TuneKey(qtype if qtype2 == qtype else f"{qtype}+{qtype2}", n, second[1] if second else 0, xq.shape[1] * 4,
                  1 << (pairs - 1).bit_length(), experts is not None)
    cfg = _TUNED.get(key)
    if cfg is None:
        scope = _tune_scope(xq.device)
        stored = tune_cache.load(scope).get(_key_text(key))
        if stored is not None and tuple(stored) in ok:
            cfg = _TUNED[key] = tuple(stored)
            return cfg
        if torch.cuda.is_current_stream_capturing():
            return ok[0]
        _precompile(lambda c: _launch(xs, raw, qtype, n, experts, c, second=second, rows_per_x=rows_per_x,
                                      warmup=True), ok, xq.device)
        copies = cold_copies(raw, 256e6)
        seconds = [second] + [(second[0].clone(), *second[1:]) for _ in copies[1:]] if second else [None] * len(copies)
        weights = list(zip(copies, seconds))
        timed = [(graph_time_us(lambda w, c=c: _launch(xs, w[0], qtype, n, experts, c, second=w[1],
                                                       rows_per_x=rows_per_x), weights), c) for c in ok]
        del copies, seconds, weights
        cfg = _TUNED[key] = min(timed)[1]
        tune_cache.store(scope, _key_text(key), cfg)
    return cfg


def _precompile(warm, configs, device) -> None:
    """Compile the kernels of every candidate configuration before they are timed, several at once on the
    host's cores (Triton's compiler releases the GIL for most of its work; one after another, the first
    start of a 9B Q4_K_M model spent over two minutes compiling). warm(config) compiles without launching.
    Best effort: on an error the launches compile what is missing, one by one, as before."""
    if len(configs) < 2:
        return

    def build(config):
        torch.cuda.set_device(device)  # a worker thread starts on device 0
        warm(config)

    try:
        warm(configs[0])  # the kernel's per-device cache exists before the workers fill it
        with ThreadPoolExecutor(min(len(configs) - 1, os.cpu_count() or 1)) as pool:
            list(pool.map(build, configs[1:]))
    except Exception as err:  # noqa: BLE001 - only a speed-up; the launches compile for themselves
        warnings.warn(f"compiling mat-vec candidates in parallel failed ({type(err).__name__}: {err}); "
                      "they compile one by one as they are timed", stacklevel=2)


def _tune_scope(device) -> str:
    """Where stored choices apply: this card, this Triton, this module's source (kernel and candidates)."""
    return f"{torch.cuda.get_device_name(device)} | triton {triton.__version__} | {_SOURCE_HASH}"


_SOURCE_HASH = tune_cache.code_hash(Path(__file__).read_text())


def _key_text(key: TuneKey) -> str:
    return "|".join(str(v) for v in key)


def tuned_configs(qtype: str, n: int, k: int) -> dict[int, tuple[int, int, int, int]]:
    """The configurations the timing picked for single-weight products of an [n, k] `qtype` weight, by
    activation rows (rounded up to a power of two)."""
    return {key.rows: cfg for key, cfg in _TUNED.items()
            if (key.qtype, key.n, key.n2, key.k, key.experts) == (qtype, n, 0, k, False)}


def _second_type(second, qtype: str) -> str:
    """The type of `second` (raw2, n2[, qtype2]): qtype2, or the first weight's."""
    return second[2] if second and len(second) > 2 else qtype


def _row_units(qtype: str, k: int) -> int:
    """A row's stride in the unit the kernel reads the type in (see _gemv_dp4a_kernel)."""
    if qtype in KQUANTS:  # interleaved rows, in 16-byte quads
        return gpu_row_words(qtype, k) // 4
    elems, nbytes = block_layout(qtype)
    return k // elems * nbytes // 2  # 16-bit halves


def _launch(xs, raw, qtype, n, experts, config, out_dtype=torch.float32, second=None, rows_per_x=1,
            warmup: bool = False) -> torch.Tensor:
    xq, act, blocked = xs
    qtype2 = _second_type(second, qtype)
    for t in (qtype, qtype2):
        if blocked != blocked_for(t):
            raise ValueError(f"{t} weights read int8 rows {'in' if blocked_for(t) else 'out of'} BLOCKED "
                             "order: quantize_rows(..., blocked=blocked_for(qtype))")
    k = xq.shape[1] * 4
    m = len(experts) if experts is not None else xq.shape[0] * rows_per_x
    n_units = k // block_layout(qtype)[0]
    check_layout(raw, qtype, k)
    if second:
        check_layout(second[0], qtype2, k)
    row_units = _row_units(qtype, k)
    block_n, sb, warps, stages = config
    bm = _block_m(m, experts)
    n_total = n + (second[1] if second else 0)
    if second and (n % block_n or (experts is not None and second[1] != n)):
        raise ValueError(f"two weights in one launch need the first's rows ({n}) a multiple of BLOCK_N "
                         f"({block_n}) and, for expert stacks, equal row counts (got {second[1]})")
    out = torch.empty(m, n_total, dtype=out_dtype, device=xq.device)
    views = []
    for w, t in ((raw, qtype), (second[0], qtype2) if second else (raw, qtype)):
        flat = w.view(-1)
        w16 = flat.view(torch.int16)
        # interleaved K-quant rows are int32 words; Q8_0 and Q4_0 blocks are read in halves
        views += [w16, flat if t in KQUANTS else w16]
    grid = (triton.cdiv(n_total, block_n), triton.cdiv(m, bm))
    args = (xq, act, *views, out, experts if experts is not None else views[0], m, n_total, n, row_units,
            _row_units(qtype2, k), n_units, n * row_units, k // 16, rows_per_x, out.stride(0))
    meta = dict(QTYPE=QTYPE_ID[qtype], QTYPE_B=QTYPE_ID[qtype2], BM=bm, BN=block_n, SB=sb, STAGES=stages,
                HAS_EXPERTS=experts is not None, TWO=second is not None,
                EVEN=m % bm == 0 and n_total % block_n == 0 and n_units % sb == 0, EMULATE=EMULATE, num_warps=warps,
                **pdl.launch_options(xq.device))
    if warmup:  # compile (as this launch would) without running
        _gemv_dp4a_kernel.warmup(*args, grid=grid, **meta)
    else:
        _gemv_dp4a_kernel[grid](*args, **meta)
    return out


def matvec(xs, raw: torch.Tensor, qtype: str, n: int, experts: torch.Tensor | None = None,
           config: tuple[int, int, int, int] | None = None, out_dtype: torch.dtype = torch.float32,
           second: tuple | None = None, rows_per_x: int = 1) -> torch.Tensor:
    """Activations already quantized by quantize_rows (xs) times quantized rows raw [(E,) N, row_bytes].

    With `experts` [P] (int32), output row p multiplies activation row p // rows_per_x by expert experts[p]
    of a stacked [E, N, ...] weight. With `second` (raw2, n2) or (raw2, n2, qtype2) of the same stacking
    (and type, or another type that reads activations in the same order: see blocked_for), the output has
    n + n2 columns, the last n2 from raw2 (one launch for two projections of the same input)."""
    cfg = config or best_config(xs, raw, qtype, n, experts, second, rows_per_x)
    return _launch(xs, raw, qtype, n, experts, cfg, out_dtype, second, rows_per_x)


def gemv(x: torch.Tensor, raw: torch.Tensor, qtype: str, n: int, config: tuple[int, int, int, int] | None = None,
         key: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times quantized rows raw [N, row_bytes] -> [M, N] in x's dtype (`key`: see quantize_rows)."""
    return matvec(quantize_rows(x, key, blocked_for(qtype)), raw, qtype, n, config=config, out_dtype=x.dtype)
