"""K-quant weights times 5-64 activation rows on tensor cores with the scales factored out of the operand
(HF2Q_QUANT_MM=factored).

mm_triton turns every quant into a scaled fp32 value, rounds it to bf16 and sends the [32, BLOCK_N] tile
through shared memory into the mma operand layout: a dozen instructions a weight value. Here the operand
is the integer quant itself, exact in bf16, and the scales come after the dot. For a Q4_K/Q5_K group of
values sharing scale s and offset o (value = q·s - o):

    Σ_k x·w = s·Σ_k x·(128 + q) - (128·s + o)·Σ_k x

The bf16 whose bits are 0x4300 | q is 128 + q for 0 <= q < 128, so four quants held one a byte of a
word become two bf16 pairs by two byte permutes (prmt) against 0x43 bytes: no conversion, no scale per
value. Each group is its own fp32 dot, multiplied by s per output; the Σx of each 16-row chunk and
group come from a dot against a 0/1 column (exact products, fp32 sums), and the offsets of a 256-value
tile are one small dot of those sums against 128·s + o in 3xtf32 (about fp32's precision). Against
mm_triton, which rounds every dequantized weight to bf16, the only roundings are the fp32 sums (with
bf16 activations: the activations' own). Q6_K's value is s·(q - 32): its operand is q - 32 itself (a bf16x2
fma subtracts 160 from 128 + q, exact), one dot a 16-value piece times s, and no Σx nor offsets at all.

The operand is loaded as it is used: dot index k of a group reads the word holding value
4·word(k) + byte(k), a thread's pack of four dot elements (k, k+1, k+8, k+9) being the four bytes of one
word; the activations are read in the same order (a permutation of K within the group). Each word is
loaded once, as a [K // 16, 4, BN] tensor, and repeated to its four dot indices by a broadcast and a
reshape that stay in registers (a [K, BN] load of the repeated words loads each four times). Groups past a row's quants never occur
(K-quant rows are whole 256-value blocks).

As in mm_triton, every 16 activation rows are their own dots with their own accumulators, and K is split by
the weight's shape alone: a row's result never depends on the other rows of the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q import envs
from hf2q.kernels.quant.dequant_triton import QTYPE_ID, _geometry, check_layout
from hf2q.kernels.quant.fields_triton import f16_bits
from hf2q.kernels.quant.mm_triton import chunks, config, program_block, split_launch, store_chunks, sum_splits

TYPES = ("Q4_K", "Q5_K", "Q6_K")  # the weight types this kernel multiplies; the others stay on mm_triton
DTYPES = (torch.bfloat16, torch.float32)  # activations it takes (fp32: an fp32 operand, IEEE dots)
EMULATE = envs.triton_interpret()  # the interpreter runs no PTX: the byte permutes in plain integer ops
MAGIC = 0x4300  # bf16 bits of 128; 0x4300 | q is 128 + q for 0 <= q < 128


@triton.jit
def _order(K: tl.constexpr):
    """(word, byte) [K] of the value that dot index k of a K-value group (K = 16 or 32) reads: value
    4·word + byte. A thread of mma.sync holds dot indices 2c + (0, 1, 8, 9) + 16s: bytes 0-3 of word c + 4s.
    (Written in // and %, which Triton's address analysis follows: the activations' pairs load as words.)"""
    k = tl.arange(0, K)
    return (k // 2) % 4 + 4 * (k // 16), 2 * ((k // 8) % 2) + k % 2


@triton.jit
def _word_ptrs(w32, row_q, nblk, K: tl.constexpr):
    """Pointers [K // 16, 4, BN] to word 4s + c of block 0's first quads (dot index k = 16s + 8b + 2c + e reads
    byte 2b + e of word 4s + c) in interleaved rows starting at quad row_q (word w of a block sits in quad
    w // 4, quad q of block t at quad q·nblk + t of the row), computed once a program: _words adds one scalar."""
    s = tl.arange(0, K // 16)[:, None, None]
    c = tl.arange(0, 4)[None, :, None]
    return w32 + (row_q[None, None, :] + s * nblk) * 4 + c


@triton.jit
def _words(ptrs, t, nblk, first: tl.constexpr):
    """Words [K, BN] of K-quant block t: row k holds block word first + word(k) (first a multiple of 4), each
    word loaded once and repeated to its four dot indices."""
    w = tl.load(ptrs + ((first // 4) * nblk + t) * 4)
    S: tl.constexpr = w.shape[0]
    BN: tl.constexpr = w.shape[2]
    return tl.reshape(tl.broadcast_to(w[:, None, :, None, :], (S, 2, 4, 2, BN)), (16 * S, BN))


@triton.jit
def _operand(fields, byte, dtype: tl.constexpr, BIAS: tl.constexpr, EMULATE: tl.constexpr):
    """The dot operand [K, BN] of BIAS + q for q the byte `byte` of each element's word `fields` (every byte
    below 128): fp32 by conversion; bf16 by byte permutes, BIAS 128 or -32 (then less 160, exact in bf16)."""
    if dtype == tl.float32:
        return ((fields >> (8 * byte)[:, None]) & 255).to(tl.float32) + BIAS
    if EMULATE:  # the same values by conversion (the interpreter's bf16 dots are not the GPU's anyway)
        return (((fields >> (8 * byte)[:, None]) & 255).to(tl.float32) + BIAS).to(tl.bfloat16)
    # A thread's four elements (k, k+1, k+8, k+9) are bytes 0-3 of one word: two prmt give the two bf16 pairs
    # (byte 0 | 0x43 << 8, byte 1 | 0x43 << 8) and (bytes 2, 3); for BIAS -32 a bf16x2 fma adds -160 (0xC320).
    tl.static_assert(BIAS == 128.0 or BIAS == -32.0)
    if BIAS == -32.0:
        return tl.inline_asm_elementwise("{ .reg .b32 c, one, less; mov.b32 c, 0x43434343; mov.b32 one, 0x3F803F80; "
                                         "mov.b32 less, 0xC320C320; prmt.b32 $0, $2, c, 0x4140; "
                                         "prmt.b32 $1, $2, c, 0x4342; fma.rn.bf16x2 $0, $0, one, less; "
                                         "fma.rn.bf16x2 $1, $1, one, less; }", "=r,=r,r,r,r,r", [fields],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise("{ .reg .b32 c; mov.b32 c, 0x43434343; prmt.b32 $0, $2, c, 0x4140; "
                                         "prmt.b32 $1, $2, c, 0x4342; }", "=r,=r,r,r,r,r", [fields],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _x_ptrs(x_ptr, m0, M, x_stride, K: tl.constexpr):
    """Pointers [16, K] to activation rows m0.. at columns 4·word(k) + byte(k) (a group's values in its dot's
    order), computed once a program; rows past M read the last one (never stored)."""
    m = tl.minimum(m0 + tl.arange(0, 16), M - 1)
    word, byte = _order(K)
    return x_ptr + m.to(tl.int64)[:, None] * x_stride + (4 * word + byte)[None, :]


@triton.jit
def _scaled_dot(acc, x_ptrs, k0, w, s, IEEE: tl.constexpr):
    """One group and 16 activation rows, no offset: acc + s·(x @ w) [16, BN]."""
    x = tl.load(x_ptrs + k0)
    if IEEE:
        return acc + tl.dot(x, w, input_precision="ieee") * s[None, :]
    return acc + tl.dot(x, w) * s[None, :]


@triton.jit
def _group_dot(acc, xsum, x_ptrs, k0, w, s, col: tl.constexpr, K: tl.constexpr, IEEE: tl.constexpr):
    """One group and 16 activation rows: acc + s·(x @ w) [16, BN], and xsum [16, 16] + Σx in column `col`
    (a dot against a 0/1 column: exact products, fp32 sums)."""
    x = tl.load(x_ptrs + k0)
    one = (tl.arange(0, 16) == col)[None, :] & (tl.arange(0, K) >= 0)[:, None]
    if IEEE:
        acc += tl.dot(x, w, input_precision="ieee") * s[None, :]
        return acc, tl.dot(x, one.to(tl.float32), xsum, input_precision="ieee")
    acc += tl.dot(x, w) * s[None, :]
    return acc, tl.dot(x, one.to(x.dtype), xsum)


@triton.jit
def _offsets(acc, xsum, coef, IEEE: tl.constexpr):
    """acc - xsum @ coef: a tile's offsets (xsum [16, 16] by group or piece, coef [16, BN])."""
    if IEEE:
        return acc - tl.dot(xsum, coef, input_precision="ieee")
    return acc - tl.dot(xsum, coef, input_precision="tf32x3")


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
def _kquant45_scales(w32, row_q, t, BIAS: tl.constexpr):
    """Per weight row and sub-block s [BN, 8] of Q4_K/Q5_K block t: s = d·sc, and BIAS·s + dmin·m in the
    [16, BN] layout of the tile's offset dot (row 2s; odd rows zero). ggml's get_scale_min_k4: sub-block
    s < 4 in bytes s and 4 + s of the 12-byte field; s >= 4 in the nibbles of byte 8 + s - 4, with the
    top bits of bytes s - 4 and s. Every (row, sub-block) once, in one thread."""
    header = w32 + (row_q + t) * 4  # quad 0 of block t: f16 d and dmin, then the 12 scale bytes
    h0 = tl.load(header)[:, None]
    s = tl.arange(0, 8)[None, :]
    shift = 8 * (s % 4)
    lo = tl.load(header + 1)[:, None] >> shift
    mid = tl.load(header + 2)[:, None] >> shift
    hi = tl.load(header + 3)[:, None] >> shift
    sc = tl.where(s < 4, lo & 63, (hi & 15) | (((lo >> 6) & 3) << 4))
    mn = tl.where(s < 4, mid & 63, ((hi >> 4) & 15) | (((mid >> 6) & 3) << 4))
    dsc = f16_bits(h0) * sc.to(tl.float32)
    coef = BIAS * dsc + f16_bits(h0 >> 16) * mn.to(tl.float32)
    return dsc, tl.trans(tl.reshape(tl.join(coef, tl.zeros_like(coef)), (coef.shape[0], 16)))


@triton.jit
def _q45k_tile(accs, sums, xs, w32, wp, row_q, t, nblk, QTYPE: tl.constexpr, CHUNKS: tl.constexpr,
               dtype: tl.constexpr, BIAS: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr):
    """The CHUNKS accumulators, Σx tables and offset coefficients after Q4_K/Q5_K block t: value 64g + 32h + l (sub-block
    G = 2g + h) is nibble h of nibble byte 32g + l (Q5_K: plus bit G of fifth-bit byte l, as 16). Quads:
    header, (Q5_K) two of fifth bits, eight of nibbles."""
    acc0, acc1, acc2, acc3 = accs
    xs0, xs1, xs2, xs3 = sums
    x0, x1, x2, x3 = xs
    dsc, coef = _kquant45_scales(w32, row_q, t, BIAS)
    scales = _columns(dsc)
    word, byte = _order(32)
    QS: tl.constexpr = 4 if QTYPE == 2 else 12  # first word of the nibbles
    if QTYPE == 3:
        fifth = _words(wp, t, nblk, 4)
    for g in tl.static_range(4):
        nib = _words(wp, t, nblk, QS + 8 * g)
        for h in tl.static_range(2):
            fields = (nib >> (4 * h)) & 0x0F0F0F0F
            if QTYPE == 3:
                fields |= ((fifth >> (2 * g + h)) << 4) & 0x10101010
            w = _operand(fields, byte, dtype, BIAS, EMULATE)
            s = scales[2 * g + h]
            k0 = t * 256 + 64 * g + 32 * h
            acc0, xs0 = _group_dot(acc0, xs0, x0, k0, w, s, 2 * (2 * g + h), 32, IEEE)
            if CHUNKS > 1:
                acc1, xs1 = _group_dot(acc1, xs1, x1, k0, w, s, 2 * (2 * g + h), 32, IEEE)
            if CHUNKS > 2:
                acc2, xs2 = _group_dot(acc2, xs2, x2, k0, w, s, 2 * (2 * g + h), 32, IEEE)
                acc3, xs3 = _group_dot(acc3, xs3, x3, k0, w, s, 2 * (2 * g + h), 32, IEEE)
    return (acc0, acc1, acc2, acc3), (xs0, xs1, xs2, xs3), coef


@triton.jit
def _q6k_fields(ql, qh, J: tl.constexpr):
    """Q6_K quants of group j = J of a half block, a byte each: nibble J // 2 of ql, bits 2J.. of qh as 16·."""
    if J < 2:
        top = qh << (4 - 2 * J)
    else:
        top = qh >> (2 * J - 4)
    return ((ql >> (4 * (J // 2))) & 0x0F0F0F0F) | (top & 0x30303030)


@triton.jit
def _pick(first, second, G: tl.constexpr, HALF: tl.constexpr):
    """Column G of the table `first` (HALF 0) or `second`."""
    if HALF == 0:
        return first[G]
    return second[G]


@triton.jit
def _q6k_tile(accs, xs, w32, wp, row_q, t, nblk, CHUNKS: tl.constexpr, dtype: tl.constexpr, IEEE: tl.constexpr,
              EMULATE: tl.constexpr):
    """The CHUNKS accumulators after Q6_K block t: value 128h + 32j + l has its low nibble in
    ql byte 64h + 32(j % 2) + l (nibble j // 2), its top two bits in qh byte 32h + l (bits 2j..), and signed
    scale 8h + 2j + l // 16 (piece p = value // 16) in words 48-51; d in the row's plane after the quads. A dot
    per 16-value piece: value = d·sc·(q - 32), the operand q - 32 itself (exact in bf16): no offsets."""
    acc0, acc1, acc2, acc3 = accs
    x0, x1, x2, x3 = xs
    d = f16_bits(tl.load(w32 + row_q * 4 + 52 * nblk + t // 2) >> (16 * (t % 2)))
    p = tl.arange(0, 16)[None, :]
    sw = tl.load(w32 + (row_q[:, None] + 12 * nblk + t) * 4 + p // 4)  # [BN, 16]: the word of scale p
    dsc = d[:, None] * ((sw << (24 - 8 * (p % 4))) >> 24).to(tl.float32)  # exact: 11 by 8 bits
    lo_pieces, hi_pieces = tl.split(tl.reshape(dsc, (dsc.shape[0], 8, 2)))  # pieces 2G and 2G + 1 of group G
    s_lo = _columns(lo_pieces)
    s_hi = _columns(hi_pieces)
    word, byte = _order(16)
    for h in tl.static_range(2):
        for half in tl.static_range(2):
            qh = _words(wp, t, nblk, 32 + 8 * h + 4 * half)
            for jlo in tl.static_range(2):
                ql = _words(wp, t, nblk, 16 * h + 8 * jlo + 4 * half)
                for jhi in tl.static_range(2):
                    w = _operand(_q6k_fields(ql, qh, 2 * jhi + jlo), byte, dtype, -32.0, EMULATE)
                    s = _pick(s_lo, s_hi, 4 * h + 2 * jhi + jlo, half)
                    col = 2 * (4 * h + 2 * jhi + jlo) + half  # the piece
                    k0 = t * 256 + 16 * col
                    acc0 = _scaled_dot(acc0, x0, k0, w, s, IEEE)
                    if CHUNKS > 1:
                        acc1 = _scaled_dot(acc1, x1, k0, w, s, IEEE)
                    if CHUNKS > 2:
                        acc2 = _scaled_dot(acc2, x2, k0, w, s, IEEE)
                        acc3 = _scaled_dot(acc3, x3, k0, w, s, IEEE)
    return acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["M"])  # one build for every row count: a new count must not compile mid-serve
def _factored_kernel(x_ptr, w32, out_ptr, M, N, K, x_stride, row_stride, nblk, tiles_per_split, n_tiles,
                     QTYPE: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, BIAS: tl.constexpr,
                     EMULATE: tl.constexpr):
    """A program: BLOCK_N weight rows times CHUNKS x 16 activation rows over one split of K; the operand holds
    BIAS + q (bf16: 128, the bit trick's)."""
    rows, row_ok, row_q, m0, split, first, last = program_block(N, row_stride, tiles_per_split, n_tiles, CHUNKS,
                                                                 BLOCK_N)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    IEEE: tl.constexpr = dtype == tl.float32
    acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)  # one accumulator per 16 activation rows
    acc1, acc2, acc3 = acc0, acc0, acc0
    GK: tl.constexpr = 16 if QTYPE == 4 else 32  # values a dot: Q6_K's 16-value pieces, else 32-value groups
    wp = _word_ptrs(w32, row_q, nblk, GK)
    x0 = _x_ptrs(x_ptr, m0, M, x_stride, GK)
    x1 = _x_ptrs(x_ptr, m0 + 16, M, x_stride, GK)
    x2 = _x_ptrs(x_ptr, m0 + 32, M, x_stride, GK)
    x3 = _x_ptrs(x_ptr, m0 + 48, M, x_stride, GK)
    for t in range(first, last):
        if QTYPE == 4:
            acc0, acc1, acc2, acc3 = _q6k_tile((acc0, acc1, acc2, acc3), (x0, x1, x2, x3), w32, wp, row_q, t, nblk,
                                               CHUNKS, dtype, IEEE, EMULATE)
        else:
            zero = tl.zeros((16, 16), dtype=tl.float32)  # Σx of the tile's groups, by chunk
            accs, sums, coef = _q45k_tile((acc0, acc1, acc2, acc3), (zero, zero, zero, zero), (x0, x1, x2, x3), w32,
                                    wp, row_q, t, nblk, QTYPE, CHUNKS, dtype, BIAS, IEEE, EMULATE)
            acc0 = _offsets(accs[0], sums[0], coef, IEEE)
            if CHUNKS > 1:
                acc1 = _offsets(accs[1], sums[1], coef, IEEE)
            if CHUNKS > 2:
                acc2 = _offsets(accs[2], sums[2], coef, IEEE)
                acc3 = _offsets(accs[3], sums[3], coef, IEEE)
    store_chunks(out_ptr, acc0, acc1, acc2, acc3, split, m0, M, N, rows, row_ok, CHUNKS)


def quant_mm_factored(x: torch.Tensor, raw: torch.Tensor, qtype: str, n: int,
                      cfg: tuple[int, int, int] | None = None, bias: float | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) times K-quant rows raw [N, row_words] (interleaved int32 rows) -> [M, N] in x's
    dtype, fp32 accumulation. `bias` (fp32 activations only; tests): the operand's BIAS + q, by default 0 for
    fp32 (fp32 sums of x·(128 + q) lose about four bits to the offset's cancellation), 128 for bf16."""
    if qtype not in TYPES or x.dtype not in DTYPES:
        raise ValueError(f"the factored kernel multiplies {', '.join(TYPES)} by bf16 or fp32 activations, not "
                         f"{qtype} by {x.dtype}")
    m, k = x.shape
    check_layout(raw, qtype, k)
    x = x.contiguous()
    row_stride, nblk, n_tiles = _geometry(qtype, k)
    block_n, warps, split = cfg or config(n, k)
    out, per_split, grid = split_launch(m, n, n_tiles, split, block_n, x.dtype, x.device)
    _factored_kernel[grid](x, raw.view(-1), out, m, n, k, x.stride(0), row_stride, nblk, per_split, n_tiles,
                           QTYPE=QTYPE_ID[qtype], CHUNKS=chunks(m), BLOCK_N=block_n,
                           BIAS=128.0 if x.dtype == torch.bfloat16 else float(bias or 0), EMULATE=EMULATE,
                           num_warps=warps)
    return sum_splits(out, x.dtype)
