"""GGUF-quantized weights times a few activation rows (batched decode, 5-64 rows) on tensor cores.

Between the int8 mat-vec (dp4a_triton, 1-4 rows, whose work grows with the rows) and prefill's
dequantize-then-cuBLAS (dequant_triton, which writes and re-reads a bf16 copy of the weight), a batch of
decode rows wants the quantized blocks read once for all its rows. A program takes BLOCK_N weight rows
over a range of 256-value tiles; each tile is walked in eight groups of 32 values that share one scale
(a K-quant sub-block, a Q8_0/Q4_0 block, half of two Q6_K sub-blocks). A group's quants are read as the
32-bit words they are stored in; K-quant fields are masked in place (Q5_K/Q6_K put together a word at a
time) and converted whole, each field's place undone by a power of two in its scale (no shift per
value, the same rounding); the values are put back in order with `tl.interleave` (no gathers, no
shared-memory reshapes), rounded to the activations' dtype (as the dequantized copy is) and multiplied
on tensor cores against the matching 32 columns of the activations. So the step costs one pass over the
quantized bytes however many rows share it (the Marlin approach, on the blocks in the layout the other
kernels read).

With `packed` (HF2Q_QUANT_MM=packed, K-quants) a group's values are made in bf16 pairs instead: each quant put
under the bits of 128.0 (exact), less 128, times the group's scale plus its min, both rounded to bf16 first, in
one bf16 fma. A third to a half fewer instructions a value (tools/quant_sass.py) but 5% less time on an H100 (a 9B
token's projections; the kernel is not bound by its instructions), for a value within 2^-8 (2 + 2^-8)
(|q scale| + |min|) of the exact weight instead of half a bf16 unit of it: opt-in.

Every 16 activation rows are their own dot with their own accumulator, and K is split over programs by
the weight's shape alone, with fp32 partial sums added in a fixed order: a row's result depends on the
weight and the configuration, never on the other rows of the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q import envs
from hf2q.kernels.quant.dequant_triton import QTYPE_ID, _geometry, check_layout
from hf2q.kernels.quant.fields_triton import f16_bits, small_float

PROGRAMS = 264  # about two programs per SM of the largest cards: split K until the grid has this many
EMULATE = envs.triton_interpret()  # the interpreter's bf16 arithmetic is wrong: `_packed` emulates it
PACKED_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # quants of at most 7 bits: exact under the bits of bf16's 128.0


@triton.jit
def _scaled_bytes(words, shift, mask, a, b):
    """a * ((byte >> shift) & mask) + b [BN, 32] in byte order for words [BN, 8] holding 32 bytes (byte
    4w + j in bits 8j.. of word w; a, b [BN, 1] or scalars). Each field is masked in place (the upper two
    bytes' after one shift of the word by 16) and made a float whole from its bits (`small_float`: exact, it
    sits below bit 23, and no int-to-float conversion), its place undone by a power of two in the scale: no
    shift per value, and the same rounding as scaling the field itself."""
    u = words.to(tl.uint32, bitcast=True)
    hi = u >> 16
    v0 = small_float(u & (mask << shift)) * (a * (1.0 / (1 << shift))) + b
    v1 = small_float(u & (mask << (8 + shift))) * (a * (1.0 / (1 << (8 + shift)))) + b
    v2 = small_float(hi & (mask << shift)) * (a * (1.0 / (1 << shift))) + b
    v3 = small_float(hi & (mask << (8 + shift))) * (a * (1.0 / (1 << (8 + shift)))) + b
    return tl.interleave(tl.interleave(v0, v2), tl.interleave(v1, v3))


@triton.jit
def _packed(words, shift: tl.constexpr, mask: tl.constexpr, offset: tl.constexpr, a, b, EMULATE: tl.constexpr):
    """bf16 [BN, 32] of fma(field - offset, a, b) for field = (byte >> shift) & mask (mask < 128) of the 32 bytes
    in words [BN, 8], in byte order; a and b (fp32, broadcast to [BN, 32]; b None: 0) rounded to bf16 first. Each
    field goes under the bits of 128.0 (0x4300, whose last place is 1), two a 32-bit word (bytes 0 and 2, then 1
    and 3): the values are exact with one shift and one LOP3 a pair, and the arithmetic is on bf16 pairs. EMULATE
    (Triton's interpreter, whose bf16 arithmetic is wrong): the same in fp32, rounded to bf16 after the fma."""
    u = words.to(tl.uint32, bitcast=True)
    m: tl.constexpr = (mask << 16) | mask
    even = ((u >> shift) & m) | 0x43004300
    odd = ((u >> (shift + 8)) & m) | 0x43004300
    v0 = (even & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    v2 = (even >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    v1 = (odd & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    v3 = (odd >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    v = tl.interleave(tl.interleave(v0, v2), tl.interleave(v1, v3))  # 128 + field
    if EMULATE:
        q = v.to(tl.float32) - (128.0 + offset)
        w = q * _bf16_rounded(a) if b is None else tl.fma(q, _bf16_rounded(a), _bf16_rounded(b))
        return _bf16_rounded(w).to(tl.bfloat16)
    q = v - (128.0 + offset)  # exact
    return q * a.to(tl.bfloat16) if b is None else tl.fma(q, a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def _bf16_rounded(x):
    """fp32 x rounded to the nearest bf16 (ties to even), as fp32: the interpreter's own conversion truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _block_words(w32, row_q, first, t, nblk):
    """Words first..first+7 [BN, 8] of K-quant block t in interleaved rows starting at quad row_q (word w of
    a block sits in quad w // 4, and quad q of block t at quad q * nblk + t of the row)."""
    w = first + tl.arange(0, 8)
    off = (row_q[:, None] + ((w // 4) * nblk + t)[None, :]) * 4 + (w % 4)[None, :]
    return tl.load(w32 + off)


@triton.jit
def _header_byte(h1, h2, h3, i: tl.constexpr):
    """Byte i (0..11) of a Q4_K/Q5_K scale field held in header words 1-3."""
    if i < 4:
        return (h1 >> (8 * i)) & 255
    elif i < 8:
        return (h2 >> (8 * (i - 4))) & 255
    else:
        return (h3 >> (8 * (i - 8))) & 255


@triton.jit
def _scale_min(h1, h2, h3, s: tl.constexpr):
    """6-bit scale and min [BN] of sub-block s (ggml's get_scale_min_k4), from the header words already in
    registers: fields_triton.kquant_scale_min reads the same fields by byte loads, which cost this kernel
    about 4% more instructions."""
    if s < 4:
        sc = _header_byte(h1, h2, h3, s) & 63
        mn = _header_byte(h1, h2, h3, s + 4) & 63
    else:
        hi = _header_byte(h1, h2, h3, s + 4)
        sc = (hi & 15) | ((_header_byte(h1, h2, h3, s - 4) >> 6) << 4)
        mn = (hi >> 4) | ((_header_byte(h1, h2, h3, s) >> 6) << 4)
    return small_float(sc), small_float(mn)


@triton.jit
def _kquant45_group(w32, row_q, t, nblk, G: tl.constexpr, QTYPE: tl.constexpr, PACKED: tl.constexpr = False,
                    EMULATE: tl.constexpr = False):
    """fp32 values [BN, 32] of sub-block G of Q4_K/Q5_K block t: value 64g + 32h + l (G = 2g + h) is nibble h
    of nibble byte 32g + l, plus (Q5_K) bit G of fifth-bit byte l as 16; times d * scale, minus dmin * min.
    PACKED: bf16 values, each one fma of the exact quant with d * scale and -dmin * min rounded to bf16."""
    QS: tl.constexpr = 4 if QTYPE == 2 else 12  # first word of the nibbles (after the header, Q5_K's fifth bits)
    header = w32 + (row_q + t) * 4  # quad 0 of block t: f16 d and dmin, then the 12 scale bytes
    h0 = tl.load(header)
    h1 = tl.load(header + 1)
    h2 = tl.load(header + 2)
    h3 = tl.load(header + 3)
    sc, mn = _scale_min(h1, h2, h3, G)
    a, b = (f16_bits(h0) * sc)[:, None], -(f16_bits(h0 >> 16) * mn)[:, None]
    q = _block_words(w32, row_q, QS + 8 * (G // 2), t, nblk)
    SHIFT: tl.constexpr = 4 * (G % 2) if QTYPE == 2 else 0
    MASK: tl.constexpr = 15 if QTYPE == 2 else 31
    if QTYPE == 3:
        fifth = _block_words(w32, row_q, 4, t, nblk)  # bit G of each byte: 16 in value G
        q = ((q >> (4 * (G % 2))) & 0x0F0F0F0F) | (((fifth >> G) << 4) & 0x10101010)
    if PACKED:  # one return: Triton wants every return of a function the same type
        values = _packed(q, SHIFT, MASK, 0.0, a, b, EMULATE)
    else:
        values = _scaled_bytes(q, SHIFT, MASK, a, b)
    return values


@triton.jit
def _q6k_group(w32, row_q, t, nblk, G: tl.constexpr, PACKED: tl.constexpr = False, EMULATE: tl.constexpr = False):
    """fp32 values [BN, 32] of group G = 4h + j of Q6_K block t: value 128h + 32j + l has its low nibble in
    ql byte 64h + 32(j % 2) + l (shifted by 4(j // 2)), its top two bits in qh byte 32h + l (shifted by 2j),
    and scale 8h + 2j + l // 16 (signed bytes in words 48-51); d sits in the row's plane after the quads.
    The 6-bit quants are put together a word (four values) at a time."""
    H: tl.constexpr = G // 4
    J: tl.constexpr = G % 4
    lo = _block_words(w32, row_q, 16 * H + 8 * (J % 2), t, nblk) >> (4 * (J // 2))
    hi = _block_words(w32, row_q, 32 + 8 * H, t, nblk)
    hi = (hi << (4 - 2 * J)) if J < 2 else (hi >> (2 * J - 4))
    q = (lo & 0x0F0F0F0F) | (hi & 0x30303030)
    S: tl.constexpr = 48 + 2 * H + J // 2  # the word holding scales 8h + 2j and 8h + 2j + 1
    sw = tl.load(w32 + (row_q + (S // 4) * nblk + t) * 4 + S % 4)
    B: tl.constexpr = 2 * (J % 2)  # their bytes in that word
    dw = tl.load(w32 + row_q * 4 + 52 * nblk + t // 2)
    d = f16_bits(dw >> (16 * (t % 2)))
    sc0 = d * ((sw << (24 - 8 * B)) >> 24).to(tl.float32)  # exact: 11 by 8 bits
    sc1 = d * ((sw << (16 - 8 * B)) >> 24).to(tl.float32)
    scale = tl.where((tl.arange(0, 32) < 16)[None, :], sc0[:, None], sc1[:, None])
    if PACKED:  # q - 32 exact in bf16, times d * sc rounded to bf16: one more rounding
        values = _packed(q, 0, 63, 32.0, scale, None, EMULATE)
    else:  # d * sc exact, so one rounding, as of d * (sc * q)
        values = _scaled_bytes(q, 0, 255, 1.0, -32.0) * scale
    return values


@triton.jit
def _q8_q4_group(w8, w16, row_base, t, nblk, G: tl.constexpr, QTYPE: tl.constexpr):
    """fp32 values [BN, 32] of block 8t + G of Q8_0 (f16 d, 32 int8) or Q4_0 (f16 d, 16 bytes: value i is
    nibble i // 16 of byte i % 16, minus 8), ggml's byte order; zeros past the row's last block."""
    BYTES: tl.constexpr = 34 if QTYPE == 0 else 18
    b = t * 8 + G
    ok = row_base * 0 + b < nblk  # a [BN] mask (a scalar comparison would not broadcast as one)
    base = row_base + b * BYTES
    d = tl.load(w16 + base // 2, mask=ok, other=0).to(tl.float32)
    i = tl.arange(0, 32)
    if QTYPE == 0:
        q = tl.load(w8 + base[:, None] + 2 + i[None, :], mask=ok[:, None], other=0).to(tl.int8, bitcast=True)
        return d[:, None] * q.to(tl.float32)
    q = tl.load(w8 + base[:, None] + 2 + (i % 16)[None, :], mask=ok[:, None], other=0).to(tl.int32)
    return d[:, None] * (((q >> (4 * (i // 16))[None, :]) & 15) - 8).to(tl.float32)


@triton.jit
def _group(w8, w16, w32, row_base, t, nblk, G: tl.constexpr, QTYPE: tl.constexpr, PACKED: tl.constexpr = False,
           EMULATE: tl.constexpr = False):
    """fp32 values [BN, 32] of weight columns 256t + 32G.. of each row (K-quants with PACKED: bf16)."""
    if QTYPE == 2 or QTYPE == 3:
        return _kquant45_group(w32, row_base, t, nblk, G, QTYPE, PACKED, EMULATE)
    elif QTYPE == 4:
        return _q6k_group(w32, row_base, t, nblk, G, PACKED, EMULATE)
    else:
        return _q8_q4_group(w8, w16, row_base, t, nblk, G, QTYPE)


@triton.jit
def _x_ptrs(x_ptr, m0, M, x_stride):
    """Pointers [16, 32] to columns 0-31 of activation rows m0.., computed once a program: the loop only
    adds a column offset. Rows past M read the last one (their results are never stored)."""
    m = tl.minimum(m0 + tl.arange(0, 16), M - 1)
    return x_ptr + m.to(tl.int64)[:, None] * x_stride + tl.arange(0, 32)[None, :]


@triton.jit
def _x_cols(ptrs, k0, K, EVEN_K: tl.constexpr):
    """[16, 32] activations at columns k0.. (masked past K unless every tile is whole, as K-quant rows are)."""
    if EVEN_K:
        return tl.load(ptrs + k0)
    return tl.load(ptrs + k0, mask=(k0 + tl.arange(0, 32) < K)[None, :], other=0)


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr):
    """acc + x @ w; w arrives in fp32 (bf16 where packed) and is rounded to x's dtype first, as the dequantized
    copy would be."""
    if IEEE:  # fp32 activations (tests, CPU): no tf32 rounding
        return tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")
    return tl.dot(x, w.to(x.dtype), acc)


@triton.jit
def _store(out_ptr, acc, split, m0, M, N, rows, row_ok):
    m = m0 + tl.arange(0, 16)
    out = out_ptr + (split * M + m).to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(m < M)[:, None] & row_ok[None, :])


@triton.jit
def store_chunks(out_ptr, acc0, acc1, acc2, acc3, split, m0, M, N, rows, row_ok, CHUNKS: tl.constexpr):
    """Write the CHUNKS accumulators [16, BLOCK_N] of activation rows m0.. into split `split` of out."""
    _store(out_ptr, acc0, split, m0, M, N, rows, row_ok)
    if CHUNKS > 1:
        _store(out_ptr, acc1, split, m0 + 16, M, N, rows, row_ok)
    if CHUNKS > 2:
        _store(out_ptr, acc2, split, m0 + 32, M, N, rows, row_ok)
        _store(out_ptr, acc3, split, m0 + 48, M, N, rows, row_ok)


@triton.jit
def program_block(N, row_stride, tiles_per_split, n_tiles, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's part of the grid (activation-row chunks, weight rows, split of K): its weight rows
    [BLOCK_N], their mask and offsets (rows past N read the last: the store drops them), its first
    activation row, its split and its 256-value tiles first..last."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_base = tl.minimum(rows, N - 1).to(tl.int64) * row_stride
    first = split * tiles_per_split
    return rows, rows < N, row_base, pid_m * CHUNKS * 16, split, first, tl.minimum(first + tiles_per_split, n_tiles)


@triton.jit(do_not_specialize=["M"])  # one build for every row count: a new count must not compile mid-serve
def _quant_mm_kernel(x_ptr, w8, w16, w32, out_ptr, M, N, K, x_stride, row_stride, nblk, tiles_per_split,
                     n_tiles, QTYPE: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                     EVEN_K: tl.constexpr, PACKED: tl.constexpr = False, EMULATE: tl.constexpr = False):
    """A program: BLOCK_N weight rows times CHUNKS x 16 activation rows over one split of K. Each chunk of 16
    rows is its own dot with its own accumulator, so a row's sums never depend on how many rows a program
    takes."""
    rows, row_ok, row_base, m0, split, first, last = program_block(N, row_stride, tiles_per_split, n_tiles, CHUNKS,
                                                                    BLOCK_N)
    acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    x0 = _x_ptrs(x_ptr, m0, M, x_stride)
    x1 = _x_ptrs(x_ptr, m0 + 16, M, x_stride)
    x2 = _x_ptrs(x_ptr, m0 + 32, M, x_stride)
    x3 = _x_ptrs(x_ptr, m0 + 48, M, x_stride)
    for t in range(first, last):
        for g in tl.static_range(8):
            w = tl.trans(_group(w8, w16, w32, row_base, t, nblk, g, QTYPE, PACKED, EMULATE))  # [32, BLOCK_N]
            k0 = t * 256 + 32 * g
            acc0 = _dot(_x_cols(x0, k0, K, EVEN_K), w, acc0, IEEE)
            if CHUNKS > 1:
                acc1 = _dot(_x_cols(x1, k0, K, EVEN_K), w, acc1, IEEE)
            if CHUNKS > 2:
                acc2 = _dot(_x_cols(x2, k0, K, EVEN_K), w, acc2, IEEE)
                acc3 = _dot(_x_cols(x3, k0, K, EVEN_K), w, acc3, IEEE)
    store_chunks(out_ptr, acc0, acc1, acc2, acc3, split, m0, M, N, rows, row_ok, CHUNKS)


def chunks(m: int) -> int:
    """16-row chunks of activations a program takes: all rows up to 64 (each weight group is dequantized
    once for them)."""
    return 1 if m <= 16 else 2 if m <= 32 else 4


def pipeline_stages(m: int) -> int | None:
    """Software-pipeline depth for m rows: two where a program takes 64 (its four accumulators and their
    activations' buffers held it to two programs a SM at Triton's three: 9-15% faster on most of a 9B token's
    projections on an H100, BENCHMARKS.md), Triton's default below. Loads only: the sums are the same."""
    return 2 if chunks(m) == 4 else None


def config(n: int, k: int, block_n: int = 64) -> tuple[int, int, int]:
    """(BLOCK_N, warps, splits of K) for an [n, k] weight; it depends on the weight alone, so every row of
    a batch is computed the same way whatever the batch. Splits bring the grid to about PROGRAMS
    programs of block_n weight rows."""
    n_tiles = triton.cdiv(k, 256)
    blocks = triton.cdiv(n, block_n)
    split = max(1, min(n_tiles, PROGRAMS // blocks, 16))
    return block_n, 4, split


def split_launch(m: int, n: int, n_tiles: int, split: int, block_n: int, out_dtype: torch.dtype, device):
    """(out [splits, m, n], 256-value tiles per split, grid) of a launch of this kernel family (mmq_triton's
    too): no split is left without tiles; with one split the kernel writes out_dtype directly, else fp32
    partial sums for sum_splits."""
    per_split = triton.cdiv(n_tiles, split)
    split = triton.cdiv(n_tiles, per_split)
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else out_dtype, device=device)
    return out, per_split, (triton.cdiv(m, 16 * chunks(m)), triton.cdiv(n, block_n), split)


def sum_splits(out: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The [m, n] result of split_launch's `out` once the kernel has written it."""
    return out[0] if out.shape[0] == 1 else out.sum(0).to(out_dtype)


def quant_mm(x: torch.Tensor, raw: torch.Tensor, qtype: str, n: int, cfg: tuple[int, int, int] | None = None,
             stages: int | None = None, packed: bool = False) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) times quantized rows raw [N, row_bytes] (K-quants: interleaved int32 rows)
    -> [M, N] in x's dtype, fp32 accumulation. `stages`: Triton's software-pipeline depth (default:
    `pipeline_stages(M)`), which sets the shared memory a program takes and so how many fit on an SM
    (tools/quant_mm_sweep.py). `packed` (bf16 x, K-quants): each value one bf16 fma of its exact quant with
    the group's scale and min rounded to bf16 (`packed_error_bound`), instead of fp32 arithmetic rounded once."""
    m, k = x.shape
    check_layout(raw, qtype, k)
    x = x.contiguous()
    row_stride, nblk, n_tiles = _geometry(qtype, k)
    block_n, warps, split = cfg or config(n, k)
    out, per_split, grid = split_launch(m, n, n_tiles, split, block_n, x.dtype, x.device)
    flat = raw.view(-1)
    w8, w16 = flat.view(torch.uint8), flat.view(torch.float16)
    _quant_mm_kernel[grid](x, w8, w16, flat if raw.dtype == torch.int32 else w16, out, m, n, k, x.stride(0),
                           row_stride, nblk, per_split, n_tiles, QTYPE=QTYPE_ID[qtype], CHUNKS=chunks(m),
                           BLOCK_N=block_n, IEEE=x.dtype == torch.float32, EVEN_K=k % 256 == 0,
                           PACKED=packed and qtype in PACKED_TYPES, EMULATE=EMULATE, num_warps=warps,
                           **({"num_stages": depth} if (depth := stages or pipeline_stages(m)) else {}))
    return sum_splits(out, x.dtype)
