"""The dp4a mat-vec's readers of GGUF blocks inside Triton (dp4a_triton's kernel calls row_products): per
weight type, the dot products of a step of blocks with int8 activation rows (int8_rows), on dp4a.

K-quants (Q4_K, Q5_K, Q6_K) read the GPU's interleaved rows (hf2q.quant.to_gpu_rows) in 16-byte quads, one
(activation row, weight row, block) unit a thread (_kquant_q45, _q6k), or with shared rows one (weight row,
block) unit a thread for up to four activation rows (_kquant_q45_rows, _q6k_rows): each word is unpacked
once and dotted with every row, so the unpacking no longer grows with the rows. Q8_0 and Q4_0 read ggml's
2-byte-aligned structs in 16-bit halves, 16-value parts a thread.
"""
from __future__ import annotations

import triton
import triton.language as tl

from hf2q.kernels.quant.fields_triton import f16_bits

NIBBLES = tl.constexpr(0x0F0F0F0F)
HIGH_NIBBLES = tl.constexpr(-0x0F0F0F10)  # 0xF0F0F0F0 as int32


@triton.jit
def below(i, n, ALWAYS: tl.constexpr):
    """i < n, known true at compile time when ALWAYS (the launch's sizes are multiples of the tiles): masks
    that fold away leave plain loads, without the predicates and zeroed registers of masked ones."""
    if ALWAYS:
        return i == i
    return i < n


@triton.jit
def _dp4a_emulated(a, b, c, SIGNED: tl.constexpr):
    """c + Σ of the four byte products of int32 words a and b in plain integer ops (the interpreter runs no
    PTX, and pays per op: no shift where a byte needs none)."""
    acc = c
    for i in tl.static_range(4):
        bi = b >> 24 if i == 3 else (b << (24 - 8 * i)) >> 24
        if SIGNED:
            ai = a >> 24 if i == 3 else (a << (24 - 8 * i)) >> 24
        else:
            ai = a & 255 if i == 0 else (a >> (8 * i)) & 255
        acc += ai * bi
    return acc


@triton.jit
def _dp4a_acc(a, b, c, SIGNED: tl.constexpr, EMULATE: tl.constexpr):
    """c + Σ of the four byte products of int32 words a and b (b's bytes signed; a's signed if SIGNED).
    Dots are chained through c word by word, so no sum ever crosses threads."""
    if EMULATE:
        return _dp4a_emulated(a, b, c, SIGNED)
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
    mask = (m_ok[:, None, None] & row_ok[None, :, None]) & below(u, n_units, EVEN)[None, None, :]
    w0 = (x_g16 * 0)[:, None, None] + row_q[None, :, None] + u[None, None, :]
    x0 = x_g16[:, None, None] + (row_q * 0)[None, :, None] + u[None, None, :]
    return mask, w0, x0


@triton.jit
def _q45_words(words, qh, c: tl.constexpr, QTYPE: tl.constexpr):
    """A word of chunk c's nibbles as two words of dp4a bytes: sub-block 2c (low nibbles) and 2c + 1 (high
    ones). Q4_K's high nibbles stay in place (bytes 16·q, scaled by 1/16 later); Q5_K adds its fifth bits,
    bits 2c and 2c + 1 of the qh word's bytes."""
    lo = words & NIBBLES
    if QTYPE == 2:
        hi = words & HIGH_NIBBLES
    else:
        hi = ((words >> 4) & NIBBLES) | (((qh >> (2 * c + 1)) & 0x01010101) << 4)
        lo |= ((qh >> (2 * c)) & 0x01010101) << 4
    return lo, hi


@triton.jit
def _scale_min(wa, wb, wh, s: tl.constexpr):
    """Sub-block s's 6-bit scale and min from the header's scale words (ggml's get_scale_min_k4), constant
    shifts: byte s of the first eight for s < 4; else byte s - 4 of the last four holds the low bits, bits
    6-7 of bytes s - 4 and s the top."""
    if s < 4:
        sc = (wa >> (8 * s)) & 63
        mn = (wb >> (8 * s)) & 63
    else:
        sc = ((wh >> (8 * s - 32)) & 15) | (((wa >> (8 * s - 26)) & 3) << 4)
        mn = ((wh >> (8 * s - 28)) & 15) | (((wb >> (8 * s - 26)) & 3) << 4)
    return sc, mn


@triton.jit
def _q45_part(part, acc, table, d_sc, d_mn, QTYPE: tl.constexpr, HIGH: tl.constexpr):
    """part + a sub-block's share, from its integer dot acc (of its low or HIGH nibbles), its activation
    group's table entry (dx, dx·Σxq, fix, Σx of its first piece) and d·scale, dmin·min. Σ q·x =
    dx·Σ (q - OFF)·xq + OFF·(Σx - dx·Σxq): centring the values on their range's middle OFF halves the part
    the int8 rounding touches, and Σx is exact."""
    OFF: tl.constexpr = 8 if QTYPE == 2 else 16
    dot = acc.to(tl.float32)
    if QTYPE == 2 and HIGH:
        dot = dot * 0.0625
    dx, _, fix, sx = table
    return part + (d_sc * (dx * dot + OFF * fix) - d_mn * sx)


@triton.jit
def _q6k_word(low, top, jhi: tl.constexpr, jlo: tl.constexpr):
    """Values 32j + l .. + 3 (j = 2·jhi + jlo) of a Q6_K half-block as dp4a bytes, stored + 32: the low
    nibble from ql (shifted by 4·jhi), the top two bits from qh (shifted by 2j)."""
    return ((low >> (4 * jhi)) & NIBBLES) | (((top >> (2 * (2 * jhi + jlo))) & 0x03030303) << 4)


@triton.jit
def _q6k_scale(scales, h: tl.constexpr, jhi: tl.constexpr, jlo: tl.constexpr, hf: tl.constexpr):
    """The int8 scale of a Q6_K half-block's piece (h, j = 2·jhi + jlo, half hf of l) as float: byte
    2·jlo + hf of scale word 2h + jhi, sign-extended by constant shifts."""
    return ((scales[2 * h + jhi] << (24 - 8 * (2 * jlo + hf))) >> 24).to(tl.float32)


@triton.jit
def _q6k_part(part, dot, table, sc):
    """part + a 16-value piece's share from its integer dot, its table entry (dx, dx·Σxq, ...) and its
    scale: the values are stored + 32, taken off through the piece's quantized sum."""
    dx, sq, _, _ = table
    return part + sc * (dx * dot.to(tl.float32) - 32 * sq)


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
                qh = w_quad[i]  # Q4_K: no fifth bits
                if QTYPE == 3:
                    qh = qh_a[i] if half == 0 else qh_b[i]
                lo, hi = _q45_words(w_quad[i], qh, c, QTYPE)
                acc_lo = _dp4a_acc(lo, xlo_quad[i], acc_lo, False, EMULATE)
                acc_hi = _dp4a_acc(hi, xhi_quad[i], acc_hi, False, EMULATE)
        for nib in tl.static_range(2):  # sub-block s = 2c + nib
            sc, mn = _scale_min(wa, wb, wh, 2 * c + nib)
            table = _quads3(act, 4 * (x0 + (4 * c + 2 * nib) * n_units), mask)
            part = _q45_part(part, acc_lo if nib == 0 else acc_hi, table, d * sc.to(tl.float32),
                             dmin * mn.to(tl.float32), QTYPE, nib == 1)
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
                        dot = _dp4a_acc(_q6k_word(low, top, jhi, jlo), x_quad[i], dot, False, EMULATE)
                    sc = _q6k_scale(scales, h, jhi, jlo, hf)
                    part = _q6k_part(part, dot, _quads3(act, 4 * piece, mask), sc)
    return part * d


@triton.jit
def _unit_plane(row_q, row_ok, u, n_units, EVEN: tl.constexpr):
    """The shared-rows readers' (weight row, block) units as [BN, SB]: their mask, their blocks' first quad
    in the interleaved weight rows, and their blocks' first piece inside an activation row (add the row's
    first piece), all in one layout."""
    mask = row_ok[:, None] & below(u, n_units, EVEN)[None, :]
    w0 = row_q[:, None] + u[None, :]
    xu = (row_q * 0)[:, None] + u[None, :]
    return mask, w0, xu


@triton.jit
def _q45_row_dots(lows, highs, xq32, piece_lo, piece_hi, mask, acc_lo, acc_hi, EMULATE: tl.constexpr):
    """One activation row's dots with a quad of unpacked words: acc_lo + lows · the quad of piece_lo,
    acc_hi + highs · the quad of piece_hi."""
    x_lo = _quads(xq32, 4 * piece_lo, mask)
    x_hi = _quads(xq32, 4 * piece_hi, mask)
    for i in tl.static_range(4):
        acc_lo = _dp4a_acc(lows[i], x_lo[i], acc_lo, False, EMULATE)
        acc_hi = _dp4a_acc(highs[i], x_hi[i], acc_hi, False, EMULATE)
    return acc_lo, acc_hi


@triton.jit
def _kquant_q45_rows(w32, xq32, act, x_g16, row_q, row_ok, u0, n_units, QTYPE: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, SB: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr):
    """_kquant_q45 with shared rows: W·x per (weight row, block) [BN, SB] for each of the BM <= 4 activation
    rows whose first pieces are the scalars x_g16 (a tuple of four; rows past BM come back zero). Each word
    of a block is loaded and unpacked once, then dotted with every row's activations: a thread keeps a
    pair of integer sums and a part per row, in separate variables."""
    QS: tl.constexpr = 1 if QTYPE == 2 else 3  # first quad of nibbles
    u = u0 + tl.arange(0, SB)
    mask, w0, xu = _unit_plane(row_q, row_ok, u, n_units, EVEN)
    head, wa, wb, wh = _quads(w32, 4 * w0, mask)  # d | dmin, then scale bytes 0-3, 4-7, 8-11
    d = f16_bits(head)
    dmin = f16_bits(head >> 16)
    if QTYPE == 3:
        qh_a = _quads(w32, 4 * (w0 + n_units), mask)
        qh_b = _quads(w32, 4 * (w0 + 2 * n_units), mask)
    x0, x1, x2, x3 = x_g16[0] + xu, x_g16[1] + xu, x_g16[2] + xu, x_g16[3] + xu  # the rows' first pieces
    part0 = tl.zeros((BN, SB), dtype=tl.float32)
    part1, part2, part3 = part0, part0, part0
    for c in tl.static_range(4):
        lo0 = tl.zeros((BN, SB), dtype=tl.int32)
        hi0, lo1, hi1, lo2, hi2, lo3, hi3 = lo0, lo0, lo0, lo0, lo0, lo0, lo0
        for half in tl.static_range(2):
            w_quad = _quads(w32, 4 * (w0 + (QS + 2 * c + half) * n_units), mask)
            qh = w_quad  # Q4_K: no fifth bits
            if QTYPE == 3:
                qh = qh_a if half == 0 else qh_b
            l0, h0 = _q45_words(w_quad[0], qh[0], c, QTYPE)
            l1, h1 = _q45_words(w_quad[1], qh[1], c, QTYPE)
            l2, h2 = _q45_words(w_quad[2], qh[2], c, QTYPE)
            l3, h3 = _q45_words(w_quad[3], qh[3], c, QTYPE)
            lows = (l0, l1, l2, l3)
            highs = (h0, h1, h2, h3)
            p_lo = (4 * c + half) * n_units
            p_hi = (4 * c + 2 + half) * n_units
            lo0, hi0 = _q45_row_dots(lows, highs, xq32, x0 + p_lo, x0 + p_hi, mask, lo0, hi0, EMULATE)
            if BM > 1:
                lo1, hi1 = _q45_row_dots(lows, highs, xq32, x1 + p_lo, x1 + p_hi, mask, lo1, hi1, EMULATE)
            if BM > 2:
                lo2, hi2 = _q45_row_dots(lows, highs, xq32, x2 + p_lo, x2 + p_hi, mask, lo2, hi2, EMULATE)
            if BM > 3:
                lo3, hi3 = _q45_row_dots(lows, highs, xq32, x3 + p_lo, x3 + p_hi, mask, lo3, hi3, EMULATE)
        for nib in tl.static_range(2):  # sub-block s = 2c + nib
            sc, mn = _scale_min(wa, wb, wh, 2 * c + nib)
            d_sc = d * sc.to(tl.float32)
            d_mn = dmin * mn.to(tl.float32)
            g = (4 * c + 2 * nib) * n_units  # the sub-block's first piece
            part0 = _q45_part(part0, lo0 if nib == 0 else hi0, _quads(act, 4 * (x0 + g), mask), d_sc, d_mn, QTYPE,
                              nib == 1)
            if BM > 1:
                part1 = _q45_part(part1, lo1 if nib == 0 else hi1, _quads(act, 4 * (x1 + g), mask), d_sc, d_mn,
                                  QTYPE, nib == 1)
            if BM > 2:
                part2 = _q45_part(part2, lo2 if nib == 0 else hi2, _quads(act, 4 * (x2 + g), mask), d_sc, d_mn,
                                  QTYPE, nib == 1)
            if BM > 3:
                part3 = _q45_part(part3, lo3 if nib == 0 else hi3, _quads(act, 4 * (x3 + g), mask), d_sc, d_mn,
                                  QTYPE, nib == 1)
    return part0, part1, part2, part3


@triton.jit
def _q6k_row_part(part, vals, xq32, act, piece, mask, sc, EMULATE: tl.constexpr):
    """part + one activation row's share of a 16-value piece: the dot of the piece's unpacked words vals with
    the row's quad at `piece`, scaled by the piece's scale and the row's table entry."""
    x_quad = _quads(xq32, 4 * piece, mask)
    dot = tl.zeros_like(vals[0])
    for i in tl.static_range(4):
        dot = _dp4a_acc(vals[i], x_quad[i], dot, False, EMULATE)
    return _q6k_part(part, dot, _quads(act, 4 * piece, mask), sc)


@triton.jit
def _q6k_rows(w32, xq32, act, x_g16, row_q, row_ok, u0, n_units, BM: tl.constexpr, BN: tl.constexpr,
              SB: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr):
    """_q6k with shared rows (as _kquant_q45_rows): W·x per (weight row, block) [BN, SB] for each of the
    BM <= 4 activation rows at x_g16, each piece's words unpacked once for all rows."""
    u = u0 + tl.arange(0, SB)
    mask, w0, xu = _unit_plane(row_q, row_ok, u, n_units, EVEN)
    d_word = tl.load(w32 + 4 * (w0 - u[None, :]) + 52 * n_units + (u // 2)[None, :], mask=mask, other=0)
    d = f16_bits(d_word >> (16 * (u % 2))[None, :])
    scales = _quads(w32, 4 * (w0 + 12 * n_units), mask)  # word 2h + j // 2: bytes 2(j % 2) + half
    x0, x1, x2, x3 = x_g16[0] + xu, x_g16[1] + xu, x_g16[2] + xu, x_g16[3] + xu  # the rows' first pieces
    part0 = tl.zeros((BN, SB), dtype=tl.float32)
    part1, part2, part3 = part0, part0, part0
    for h in tl.static_range(2):
        qh0 = _quads(w32, 4 * (w0 + (8 + 2 * h) * n_units), mask)
        qh1 = _quads(w32, 4 * (w0 + (9 + 2 * h) * n_units), mask)
        for jlo in tl.static_range(2):
            ql0 = _quads(w32, 4 * (w0 + (4 * h + 2 * jlo) * n_units), mask)
            ql1 = _quads(w32, 4 * (w0 + (4 * h + 2 * jlo + 1) * n_units), mask)
            for jhi in tl.static_range(2):
                for hf in tl.static_range(2):
                    low = ql0 if hf == 0 else ql1
                    top = qh0 if hf == 0 else qh1
                    vals = (_q6k_word(low[0], top[0], jhi, jlo), _q6k_word(low[1], top[1], jhi, jlo),
                            _q6k_word(low[2], top[2], jhi, jlo), _q6k_word(low[3], top[3], jhi, jlo))
                    sc = _q6k_scale(scales, h, jhi, jlo, hf)
                    p = (8 * h + 2 * (2 * jhi + jlo) + hf) * n_units
                    part0 = _q6k_row_part(part0, vals, xq32, act, x0 + p, mask, sc, EMULATE)
                    if BM > 1:
                        part1 = _q6k_row_part(part1, vals, xq32, act, x1 + p, mask, sc, EMULATE)
                    if BM > 2:
                        part2 = _q6k_row_part(part2, vals, xq32, act, x2 + p, mask, sc, EMULATE)
                    if BM > 3:
                        part3 = _q6k_row_part(part3, vals, xq32, act, x3 + p, mask, sc, EMULATE)
    return part0 * d, part1 * d, part2 * d, part3 * d


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
        u_ok = below(u, n_units, EVEN)
    else:  # Q4_0's four words make one part
        u_ok = below(u, n_units, EVEN) & (hf == 0)
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
def _stack_rows(s0, s1, s2, s3, BM: tl.constexpr, BN: tl.constexpr):
    """Rows s0 .. s3 [BN] as [BM, BN] (the first BM of them)."""
    if BM == 1:
        rows = s0[None, :]
    elif BM == 2:
        rows = tl.permute(tl.join(s0, s1), (1, 0))
    else:  # [BN, 2, 2], row 2j + i at [:, i, j]
        rows = tl.reshape(tl.permute(tl.join(tl.join(s0, s1), tl.join(s2, s3)), (2, 1, 0)), (BM, BN))
    return rows


@triton.jit
def _shared_row_products(w32, xq_ptr, act_ptr, x_g16, row_base, row_ok, n_units, QTYPE: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, STAGES: tl.constexpr,
                         EVEN: tl.constexpr, EMULATE: tl.constexpr):
    """row_products of K-quants with shared rows: a sum [BN, SB] per activation row, each its own variable,
    reduced and stacked at the end."""
    tl.static_assert(BM <= 4)
    acc0 = tl.zeros((BN, SB), dtype=tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    for u0 in tl.range(0, n_units, SB, num_stages=STAGES):
        if QTYPE == 4:
            parts = _q6k_rows(w32, xq_ptr, act_ptr, x_g16, row_base, row_ok, u0, n_units, BM, BN, SB, EVEN, EMULATE)
        else:
            parts = _kquant_q45_rows(w32, xq_ptr, act_ptr, x_g16, row_base, row_ok, u0, n_units, QTYPE, BM, BN, SB,
                                     EVEN, EMULATE)
        acc0 += parts[0]
        if BM > 1:
            acc1 += parts[1]
        if BM > 2:
            acc2 += parts[2]
        if BM > 3:
            acc3 += parts[3]
    return _stack_rows(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1), BM,
                       BN)


@triton.jit
def row_products(w16, w32, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, n_units, QTYPE: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, STAGES: tl.constexpr, SHARED: tl.constexpr,
                 EVEN: tl.constexpr, EMULATE: tl.constexpr):
    """The blocks of BN weight rows (of type QTYPE, from row_base) times BM activation rows, walked SB
    blocks a step: parts [BM, BN, PARTS] summed elementwise, reduced by the caller. SHARED (K-quants,
    BM <= 4): x_g16 is a tuple of four rows' first pieces (scalars), each unit is read once for all rows,
    and the parts come summed ([BM, BN, 1])."""
    if SHARED:
        acc = _shared_row_products(w32, xq_ptr, act_ptr, x_g16, row_base, row_ok, n_units, QTYPE, BM, BN, SB,
                                   STAGES, EVEN, EMULATE)[:, :, None]
    else:
        PARTS: tl.constexpr = SB * 2 if QTYPE <= 1 else SB
        acc = tl.zeros((BM, BN, PARTS), dtype=tl.float32)
        for u0 in tl.range(0, n_units, SB, num_stages=STAGES):
            if QTYPE == 2 or QTYPE == 3:
                acc += _kquant_q45(w32, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, u0, n_units, QTYPE, BM, BN,
                                   SB, EVEN, EMULATE)
            elif QTYPE == 4:
                acc += _q6k(w32, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, u0, n_units, BM, BN, SB, EVEN,
                            EMULATE)
            else:
                acc += _q8_q4(w16, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, u0, n_units, QTYPE, BM, BN, SB,
                              EVEN, EMULATE)
    return acc
