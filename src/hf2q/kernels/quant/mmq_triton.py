"""GGUF weights (Q8_0, Q4_K, Q5_K, Q6_K) times 5-64 int8-quantized activation rows on int8 tensor cores
(llama.cpp's MMQ).

The bf16 tile kernel (mm_triton) spends about a dozen instructions per weight value turning quants into
scaled bf16 operands. Here the activations arrive already rounded to int8 with one scale dx per 32
values (int8_rows, as the mat-vec reads them), so a weight group's raw quants are the dot's other
operand almost as they are: bits masked out of the words they are stored in, no conversion, no scale.
Each 32-value group is an int8 x int8 -> int32 dot over 16 activation rows, and the scales come after
it, once per output rather than once per weight value. The arithmetic is the dp4a mat-vec's:

    Q8_0:  Σ x·w ≈ d·dx·Σ q·xq
    Q4_K:  Σ x·w ≈ d·sc·(dx·Σ q·xq + 8·(Σx - dx·Σxq)) - dmin·m·Σx   (odd sub-blocks: q - 8 read in place)
    Q5_K:  Σ x·w ≈ d·sc·dx·Σ (q - 16)·xq + (16·d·sc - dmin·m)·Σx
    Q6_K:  Σ x·w ≈ d·Σ_pieces sc·dx·Σ (q - 32)·xq                      (a scale per 16 values)

(centring the quants leaves the int8 rounding only the centred part; Σx is exact). As in mm_triton,
every 16 activation rows are their own dot with their own accumulator and K is split by the weight's
shape alone, so a row's result never depends on the other rows of the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q import envs
from hf2q.kernels.quant import mm_triton
from hf2q.kernels.quant.dequant_triton import QTYPE_ID, _geometry, check_layout
from hf2q.kernels.quant.fields_triton import f16_bits, int_float
from hf2q.kernels.quant.int8_rows import Int8Rows, blocked_for, quantize_rows
from hf2q.kernels.quant.mm_triton import chunks, program_block, split_launch, store_chunks, sum_splits

TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the weight types this kernel multiplies; the others stay on mm_triton
EMULATE = envs.triton_interpret()  # the interpreter runs no PTX: bit operations in plain integer ops


@triton.jit
def _x_rows(xq8, act, m0, M, K):
    """Pointers to activation rows m0.. [16] in the int8 values and in the piece table (rows past M
    point at the last: their results are never stored); per group only a scalar offset is added."""
    m = tl.minimum(m0 + tl.arange(0, 16), M - 1).to(tl.int64)
    return xq8 + m * K, act + m * (K // 16) * 4


@triton.jit
def _x_group(x_row, act_row, piece0, step):
    """Int8 activations [16, 32] of the 32-value group whose two 16-value pieces sit at positions piece0 and
    piece0 + step (BLOCKED rows: step = blocks a row; rows in order: 1), and the group's dx [16] (kept
    with its first piece)."""
    c = tl.arange(0, 32)
    x = tl.load(x_row[:, None] + ((piece0 + (c // 16) * step) * 16 + c % 16)[None, :])
    return x, tl.load(act_row + piece0 * 4)


@triton.jit
def _x_sums(act_row, t, nblk, FIX: tl.constexpr):
    """Per group G of tile t [16, 16]: Σx in column 2G; with FIX (Q4_K), for even G (read as raw nibbles)
    Σx - dx·Σxq in column 2G + 1; zeros in the others (a dot needs K of 16)."""
    j = tl.arange(0, 16)
    G = j // 2
    off = G * 8 * nblk + 4 * t + 3 - j % 2  # the group's first piece: (dx, dx·Σxq, Σx - dx·Σxq, Σx)
    return tl.load(act_row[:, None] + off[None, :], mask=((j % 2 == 0) | ((G % 2 == 0) & FIX))[None, :],
                   other=0.0)


@triton.jit
def _x_scales(act_row, t, nblk):
    """dx of the eight groups of tile t [16, 8] (BLOCKED rows)."""
    G = tl.arange(0, 8)
    return tl.load(act_row[:, None] + (G * 8 * nblk + 4 * t)[None, :])


@triton.jit
def _tile_dx(acts, t, nblk, CHUNKS: tl.constexpr):
    """Per chunk of rows, each group's dx [16] of tile t (a tuple of eight), read once a tile rather than
    once a group."""
    a0, a1, a2, a3 = acts
    dx0 = _columns(_x_scales(a0, t, nblk))
    dx1, dx2, dx3 = dx0, dx0, dx0
    if CHUNKS > 1:
        dx1 = _columns(_x_scales(a1, t, nblk))
    if CHUNKS > 2:
        dx2 = _columns(_x_scales(a2, t, nblk))
        dx3 = _columns(_x_scales(a3, t, nblk))
    return dx0, dx1, dx2, dx3


@triton.jit
def _tf32_split(v):
    """v (fp32) as hi + lo, hi its top 11 significant bits (exact in tf32), lo the rest (tf32 keeps 11 of
    its bits): products of the parts on tf32 tensor cores carry about 22 bits of v."""
    hi = (v.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, v - hi


@triton.jit
def _nibbles(b, h: tl.constexpr):
    """Nibble h of int8 bytes b as the dot's int8 operand, by one bit operation on the words the bytes
    sit in (the compiler keeps bitwise byte operations on whole registers; shifts it would split): the
    low nibble as it is, q; the high one centred where it lies, 16·(q - 8) (q ^ 8 is q - 8 as a signed
    nibble)."""
    if h == 0:
        return b & 15
    return (b & -16) ^ -128  # & 0xF0, ^ 0x80


@triton.jit
def _q5k_operand(b, qh, h: tl.constexpr, G: tl.constexpr, EMULATE: tl.constexpr):
    """int8 [BN, 32] of 8·(q - 16) for Q5_K values q = (nibble h of bytes b) | (bit G of bytes qh) << 4: q in
    bits 3-7 with the top bit flipped, made on the words the bytes sit in (PTX; the interpreter, which runs
    none, in plain integer ops)."""
    if EMULATE:
        q = (((b.to(tl.int32) & 255) >> (4 * h)) & 15) | ((((qh.to(tl.int32) & 255) >> G) & 1) << 4)
        return (q * 8 - 128).to(tl.int8)
    if h == 0:  # the nibble up 3 bits (or down 1), the fifth bit from G up to 7 (7 - G in every byte of $3)
        asm: tl.constexpr = "shl.b32 a, $1, 3;"
    else:
        asm: tl.constexpr = "shr.b32 a, $1, 1;"
    return tl.inline_asm_elementwise("{ .reg .b32 a, c, s; " + asm + " and.b32 s, $3, 7; shl.b32 c, $2, s; and.b32 "
                                     "a, a, 0x78787878; and.b32 c, c, 0x80808080; or.b32 a, a, c; xor.b32 $0, a, "
                                     "0x80808080; }", "=r,r,r,r", [b, qh, tl.full(b.shape, 7 - G, tl.int8)],
                                     dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _kquant_scales(w32, row_q, t, QTYPE: tl.constexpr):
    """Per weight row and sub-block s [BN, 8] of Q4_K/Q5_K block t: what its dot is multiplied by, and
    the [BN, 16] coefficients of _x_sums' columns. Q4_K: d·sc (odd s, read as 16·(q - 8): d·sc / 16); Σx
    times -dmin·m (odd s: 8·d·sc - dmin·m), even s's Σx - dx·Σxq times 8·d·sc. Q5_K (read as 8·(q - 16)):
    d·sc / 8; Σx times 16·d·sc - dmin·m. All sub-blocks at once, each (row, sub-block) in one thread: a
    per-group [BN] vector would be computed again by every thread that holds its columns."""
    header = w32 + (row_q + t) * 4  # quad 0 of block t: f16 d and dmin, then the 12 scale bytes (ggml's
    h0 = tl.load(header)[:, None]  # get_scale_min_k4: sub-block s < 4 in bytes s and 4 + s; s >= 4 in
    s = tl.arange(0, 8)[None, :]  # the nibbles of byte 8 + s - 4, with the top bits of bytes s - 4 and s)
    shift = 8 * (s % 4)
    lo = tl.load(header + 1)[:, None] >> shift
    mid = tl.load(header + 2)[:, None] >> shift
    hi = tl.load(header + 3)[:, None] >> shift
    sc = tl.where(s < 4, lo & 63, (hi & 15) | (((lo >> 6) & 3) << 4))
    mn = tl.where(s < 4, mid & 63, ((hi >> 4) & 15) | (((mid >> 6) & 3) << 4))
    dsc = f16_bits(h0) * sc.to(tl.float32)
    dmn = f16_bits(h0 >> 16) * mn.to(tl.float32)
    if QTYPE == 3:
        return dsc * 0.125, tl.reshape(tl.join(16.0 * dsc - dmn, tl.zeros_like(dsc)), (dsc.shape[0], 16))
    odd = s % 2 == 1
    sums = tl.join(tl.where(odd, 8.0 * dsc - dmn, -dmn), tl.where(odd, 0.0, 8.0 * dsc))
    return tl.where(odd, dsc * 0.0625, dsc), tl.reshape(sums, (dsc.shape[0], 16))


@triton.jit
def _columns(table):
    """The eight columns of table [BN, 8], as a tuple of [BN]."""
    even, odd = tl.split(tl.reshape(table, (table.shape[0], 4, 2)))
    e0, e1 = tl.split(tl.reshape(even, (table.shape[0], 2, 2)))
    o0, o1 = tl.split(tl.reshape(odd, (table.shape[0], 2, 2)))
    c0, c4 = tl.split(e0)
    c2, c6 = tl.split(e1)
    c1, c5 = tl.split(o0)
    c3, c7 = tl.split(o1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _chunk(acc, x_row, act_row, piece0, step, wq, scale, dx):
    """acc + dx·scale·(wq·xq) for one group and 16 activation rows [16, BN] (dx: the group's [16], or None
    to read it)."""
    x, dx_read = _x_group(x_row, act_row, piece0, step)
    if dx is None:
        dx = dx_read
    dot = tl.dot(x, wq, out_dtype=tl.int32)
    return acc + (int_float(dot) * dx[:, None]) * scale[None, :]  # |dot| <= 32 * 127 * 127


@triton.jit
def _sums(acc, act_row, t, nblk, c_hi, c_lo, FIX: tl.constexpr):
    """acc + the tile's terms in Σx and Σx - dx·Σxq (_x_sums times the coefficients of _kquant_scales): one
    small dot a tile instead of multiply-adds per output and group, in three tf32 dots of split operands
    (about fp32's precision)."""
    s_hi, s_lo = _tf32_split(_x_sums(act_row, t, nblk, FIX))
    acc = tl.dot(s_hi, c_lo, acc, input_precision="tf32")
    acc = tl.dot(s_lo, c_hi, acc, input_precision="tf32")
    return tl.dot(s_hi, c_hi, acc, input_precision="tf32")


@triton.jit
def _q45k_tile(accs, xs, acts, w8, w32, row_q, t, nblk, QTYPE: tl.constexpr, CHUNKS: tl.constexpr,
               EMULATE: tl.constexpr):
    """The CHUNKS accumulators after Q4_K/Q5_K block t: its Σx terms, then its sub-blocks' dots. Quads:
    header, (Q5_K) two of fifth bits (bit s of byte l for sub-block s), eight of nibbles."""
    acc0, acc1, acc2, acc3 = accs
    x0, x1, x2, x3 = xs
    a0, a1, a2, a3 = acts
    FIX: tl.constexpr = QTYPE == 2
    dsc, coef = _kquant_scales(w32, row_q, t, QTYPE)
    c_hi, c_lo = _tf32_split(tl.trans(coef))
    acc0 = _sums(acc0, a0, t, nblk, c_hi, c_lo, FIX)
    if CHUNKS > 1:
        acc1 = _sums(acc1, a1, t, nblk, c_hi, c_lo, FIX)
    if CHUNKS > 2:
        acc2 = _sums(acc2, a2, t, nblk, c_hi, c_lo, FIX)
        acc3 = _sums(acc3, a3, t, nblk, c_hi, c_lo, FIX)
    scales = _columns(dsc)
    dx0, dx1, dx2, dx3 = _tile_dx(acts, t, nblk, CHUNKS)
    if QTYPE == 3:
        qh = _quads_bytes(w8, row_q, 1, t, nblk)
    for g in tl.static_range(4):
        b = _quads_bytes(w8, row_q, 1 + 2 * g + 2 * (QTYPE == 3), t, nblk)  # nibble bytes 32g..: values
        for h in tl.static_range(2):  # 64g + l (low nibbles) and 64g + 32 + l (high)
            if QTYPE == 3:
                wq = tl.trans(_q5k_operand(b, qh, h, 2 * g + h, EMULATE))
            else:
                wq = tl.trans(_nibbles(b, h))
            piece0 = 2 * (2 * g + h) * nblk + t
            sg = scales[2 * g + h]
            acc0 = _chunk(acc0, x0, a0, piece0, nblk, wq, sg, dx0[2 * g + h])
            if CHUNKS > 1:
                acc1 = _chunk(acc1, x1, a1, piece0, nblk, wq, sg, dx1[2 * g + h])
            if CHUNKS > 2:
                acc2 = _chunk(acc2, x2, a2, piece0, nblk, wq, sg, dx2[2 * g + h])
                acc3 = _chunk(acc3, x3, a3, piece0, nblk, wq, sg, dx3[2 * g + h])
    return acc0, acc1, acc2, acc3


@triton.jit
def _quads_bytes(w8, row_q, first: tl.constexpr, t, nblk):
    """Bytes [BN, 32] (int8) of quads first and first + 1 of K-quant block t in interleaved rows."""
    c = tl.arange(0, 32)
    quad = (first + c // 16) * nblk + t
    return tl.load(w8 + (row_q[:, None] + quad[None, :]) * 16 + (c % 16)[None, :])


@triton.jit
def _q6k_operand(ql, qh, J: tl.constexpr, EMULATE: tl.constexpr):
    """int8 [BN, 32] of 4·(q - 32) for Q6_K values q = (nibble J // 2 of ql) | (bits 2J.. of qh) << 4: q in
    bits 2-7 with the top bit flipped, made on the words the bytes sit in (five bit operations per four
    values; the interpreter, which runs no PTX, in plain integer ops)."""
    if EMULATE:
        lo = ((ql.to(tl.int32) & 255) >> (4 * (J // 2))) & 15
        hi = ((qh.to(tl.int32) & 255) >> (2 * J)) & 3
        return ((lo | (hi << 4)) * 4 - 128).to(tl.int8)
    if J == 0:  # the low nibble moves up 2 bits, the top bits from 2J up to 6
        asm: tl.constexpr = "shl.b32 a, $1, 2; shl.b32 b, $2, 6;"
    elif J == 1:
        asm: tl.constexpr = "shl.b32 a, $1, 2; shl.b32 b, $2, 4;"
    elif J == 2:  # the high nibble moves down 2
        asm: tl.constexpr = "shr.b32 a, $1, 2; shl.b32 b, $2, 2;"
    else:
        asm: tl.constexpr = "shr.b32 a, $1, 2; mov.b32 b, $2;"
    return tl.inline_asm_elementwise("{ .reg .b32 a, b; " + asm + " and.b32 a, a, 0x3C3C3C3C; and.b32 b, b, "
                                     "0xC0C0C0C0; or.b32 a, a, b; xor.b32 $0, a, 0x80808080; }", "=r,r,r", [ql, qh],
                                     dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _chunk6(acc, x_row, act_row, piece0, nblk, wq, sc_a, sc_b, d4):
    """acc + d·dx·(sc_a·Σ_a + sc_b·Σ_b) for one group and 16 activation rows [16, BN], Σ over each 16-value
    piece of 4·(q - 32)·xq: the dots of the two pieces apart (int8 dots take K = 32: the other piece's
    activations read as zeros), joined in integers (at most 2^27), one conversion."""
    c = tl.arange(0, 32)
    cols = (piece0 + (c // 16) * nblk) * 16 + c % 16
    x_a = tl.load(x_row[:, None] + cols[None, :], mask=(c < 16)[None, :], other=0)
    x_b = tl.load(x_row[:, None] + cols[None, :], mask=(c >= 16)[None, :], other=0)
    dx = tl.load(act_row + piece0 * 4)  # read here, not once a tile as Q4_K's: that spills registers at 64 rows
    dot = tl.dot(x_a, wq, out_dtype=tl.int32) * sc_a[None, :] + tl.dot(x_b, wq, out_dtype=tl.int32) * sc_b[None, :]
    return acc + (dot.to(tl.float32) * dx[:, None]) * d4[None, :]


@triton.jit
def _q6k_tile(accs, xs, acts, w8, w32, row_q, t, nblk, CHUNKS: tl.constexpr, EMULATE: tl.constexpr):
    """The CHUNKS accumulators after Q6_K block t: ql (quads 0-7), qh (8-11), int8 scales per 16 values
    (quad 12); d in the plane after the quads. Value 128h + 32j + l (group 4h + j) has its low nibble in
    ql byte 64h + 32(j % 2) + l (nibble j // 2), its top bits in qh byte 32h + l (bits 2j..), its scale at
    2·(4h + j) + l // 16: no Σx term, the values are centred as they are read."""
    acc0, acc1, acc2, acc3 = accs
    x0, x1, x2, x3 = xs
    a0, a1, a2, a3 = acts
    d4 = f16_bits(tl.load(w32 + row_q * 4 + 52 * nblk + t // 2) >> (16 * (t % 2))) * 0.25
    i = tl.arange(0, 16)
    sc = tl.load(w8 + (row_q[:, None] + 12 * nblk + t) * 16 + i[None, :]).to(tl.int32)  # [BN, 16]
    first, second = tl.split(tl.reshape(sc, (sc.shape[0], 8, 2)))  # each group's two pieces
    sa = _columns(first)
    sb = _columns(second)
    for h in tl.static_range(2):
        qh = _quads_bytes(w8, row_q, 8 + 2 * h, t, nblk)
        for jlo in tl.static_range(2):
            ql = _quads_bytes(w8, row_q, 4 * h + 2 * jlo, t, nblk)
            for jhi in tl.static_range(2):
                wq = tl.trans(_q6k_operand(ql, qh, 2 * jhi + jlo, EMULATE))
                piece0 = 2 * (4 * h + 2 * jhi + jlo) * nblk + t
                s_a = sa[4 * h + 2 * jhi + jlo]
                s_b = sb[4 * h + 2 * jhi + jlo]
                acc0 = _chunk6(acc0, x0, a0, piece0, nblk, wq, s_a, s_b, d4)
                if CHUNKS > 1:
                    acc1 = _chunk6(acc1, x1, a1, piece0, nblk, wq, s_a, s_b, d4)
                if CHUNKS > 2:
                    acc2 = _chunk6(acc2, x2, a2, piece0, nblk, wq, s_a, s_b, d4)
                    acc3 = _chunk6(acc3, x3, a3, piece0, nblk, wq, s_a, s_b, d4)
    return acc0, acc1, acc2, acc3


@triton.jit
def _q8_tile(accs, xs, acts, w8, w16, row_base, t, nblk, CHUNKS: tl.constexpr):
    """The CHUNKS accumulators after Q8_0 blocks 8t.. (ggml's structs: f16 d, 32 int8 quants, 2-byte
    aligned; rows of nblk blocks, the last tile maybe partial): the quants are the dot's operand as they
    are stored, against activations in the row's order (as Q8_0 weights read them). Groups past the row's
    last block (a partial last tile) read that block's activations against zero weights."""
    acc0, acc1, acc2, acc3 = accs
    x0, x1, x2, x3 = xs
    a0, a1, a2, a3 = acts
    c = tl.arange(0, 32)
    for g in tl.static_range(8):
        b = t * 8 + g
        ok = row_base * 0 + b < nblk  # a [BN] mask (a scalar comparison would not broadcast as one)
        base = row_base + b * 34
        d = tl.load(w16 + base // 2, mask=ok, other=0).to(tl.float32)
        wq = tl.trans(tl.load(w8 + base[:, None] + 2 + c[None, :], mask=ok[:, None], other=0))
        piece0 = tl.minimum(b, nblk - 1) * 2
        acc0 = _chunk(acc0, x0, a0, piece0, 1, wq, d, None)
        if CHUNKS > 1:
            acc1 = _chunk(acc1, x1, a1, piece0, 1, wq, d, None)
        if CHUNKS > 2:
            acc2 = _chunk(acc2, x2, a2, piece0, 1, wq, d, None)
            acc3 = _chunk(acc3, x3, a3, piece0, 1, wq, d, None)
    return acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["M"])  # one build for every row count: a new count must not compile mid-serve
def _mmq_kernel(xq8, act, w8, w32, out_ptr, M, N, K, row_stride, nblk, tiles_per_split, n_tiles,
                QTYPE: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    """A program: BLOCK_N weight rows times CHUNKS x 16 activation rows over one split of K."""
    rows, row_ok, row_q, m0, split, first, last = program_block(N, row_stride, tiles_per_split, n_tiles, CHUNKS,
                                                                 BLOCK_N)
    acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)  # one accumulator per 16 activation rows
    acc1, acc2, acc3 = acc0, acc0, acc0
    x0, a0 = _x_rows(xq8, act, m0, M, K)
    x1, a1 = _x_rows(xq8, act, m0 + 16, M, K)
    x2, a2 = _x_rows(xq8, act, m0 + 32, M, K)
    x3, a3 = _x_rows(xq8, act, m0 + 48, M, K)
    for t in range(first, last):
        if QTYPE == 0:  # w32 is the blocks' float16 view here, for their d
            acc0, acc1, acc2, acc3 = _q8_tile((acc0, acc1, acc2, acc3), (x0, x1, x2, x3), (a0, a1, a2, a3), w8, w32,
                                              row_q, t, nblk, CHUNKS)
        elif QTYPE == 2 or QTYPE == 3:
            acc0, acc1, acc2, acc3 = _q45k_tile((acc0, acc1, acc2, acc3), (x0, x1, x2, x3), (a0, a1, a2, a3), w8,
                                                w32, row_q, t, nblk, QTYPE, CHUNKS, EMULATE)
        else:
            acc0, acc1, acc2, acc3 = _q6k_tile((acc0, acc1, acc2, acc3), (x0, x1, x2, x3), (a0, a1, a2, a3), w8, w32,
                                               row_q, t, nblk, CHUNKS, EMULATE)
    store_chunks(out_ptr, acc0, acc1, acc2, acc3, split, m0, M, N, rows, row_ok, CHUNKS)


def config(n: int, k: int, m: int) -> tuple[int, int, int]:
    """(BLOCK_N, warps, splits of K) for an [n, k] weight and m activation rows. The split depends on the
    weight alone (enough for about PROGRAMS programs of 128 weight rows), so every row is summed the same
    way whatever the batch; BLOCK_N changes which program computes an output, not how. Up to 32 rows
    take 128 weight rows a program: the activations' loads and scales are shared by twice the weight
    values (sm_90 machine code, tools/quant_sass.py: Q4_K 3.9 instructions a weight value at 16 rows
    against 5.2 with 64, 6.0 against 7.7 at 32); 64 rows keep 64, within the registers."""
    return (128 if m <= 32 else 64), 4, mm_triton.config(n, k, 128)[2]


def quant_mmq(x: torch.Tensor | Int8Rows, raw: torch.Tensor, qtype: str, n: int, out_dtype: torch.dtype | None = None,
              cfg: tuple[int, int, int] | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (or its Int8Rows: BLOCKED for K-quants) times quantized rows raw [N, row_words] (interleaved
    K-quant rows; Q8_0: ggml's bytes) -> [M, N] in x's dtype (out_dtype for Int8Rows), fp32 accumulation
    (`key`: see quantize_rows)."""
    if qtype not in TYPES:
        raise ValueError(f"the int8 tensor-core kernel multiplies {', '.join(TYPES)}, not {qtype}")
    if isinstance(x, Int8Rows):
        rows8 = x
        out_dtype = out_dtype or torch.float32
    else:
        out_dtype = out_dtype or x.dtype
        rows8 = quantize_rows(x, key, blocked=blocked_for(qtype))
    if rows8.blocked != blocked_for(qtype):
        order = "BLOCKED int8 rows (quantize_rows(..., blocked=True))" if blocked_for(qtype) else "int8 rows in order"
        raise ValueError(f"{qtype} weights read {order}")
    m, k = rows8.xq.shape[0], rows8.xq.shape[1] * 4
    check_layout(raw, qtype, k)
    row_stride, nblk, n_tiles = _geometry(qtype, k)
    block_n, warps, split = cfg or config(n, k, m)
    out, per_split, grid = split_launch(m, n, n_tiles, split, block_n, out_dtype, raw.device)
    flat = raw.view(-1)
    w32 = flat if raw.dtype == torch.int32 else flat.view(torch.float16)  # Q8_0: its d through float16
    _mmq_kernel[grid](rows8.xq.view(torch.int8), rows8.act, flat.view(torch.int8), w32, out, m, n, k, row_stride,
                      nblk, per_split, n_tiles, QTYPE=QTYPE_ID[qtype], CHUNKS=chunks(m), BLOCK_N=block_n,
                      EMULATE=EMULATE, num_warps=warps)
    return sum_splits(out, out_dtype)
