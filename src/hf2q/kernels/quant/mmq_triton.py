"""GGUF K-quant weights times 5-64 int8-quantized activation rows on int8 tensor cores (llama.cpp's MMQ).

The bf16 tile kernel (mm_triton) spends about a dozen instructions per weight value turning quants into
scaled bf16 operands. Here the activations arrive already rounded to int8 with one scale dx per 32
values (int8_rows, as the mat-vec reads them), so a weight group's raw quants are the dot's other
operand as they are: nibbles masked out of the bytes they are stored in, no conversion, no scale. Each
32-value group is one int8 x int8 -> int32 dot over 16 activation rows, and the scales come after it,
once per output rather than once per weight value:

    Q4_K:  Σ x·w ≈ d·sc·(dx·Σ q·xq + 8·(Σx - dx·Σxq)) - dmin·m·Σx

(the dp4a mat-vec's arithmetic: centring the nibbles on 8 leaves the int8 rounding only the centred
part, and Σx is exact). As in mm_triton, every 16 activation rows are their own dot with their own
accumulator and K is split by the weight's shape alone, so a row's result never depends on the other
rows of the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q.kernels.quant.dequant_triton import QTYPE_ID, _geometry, check_layout
from hf2q.kernels.quant.fields_triton import f16_bits
from hf2q.kernels.quant.int8_rows import Int8Rows, quantize_rows
from hf2q.kernels.quant.mm_triton import _scale_min, chunks, config, program_block, store_chunks

TYPES = ("Q4_K",)  # the weight types this kernel multiplies; the others stay on mm_triton


@triton.jit
def _x_group(xq8, act, m0, M, K, piece0, nblk):
    """Int8 activations [16, 32] of rows m0.. (rows past M read the last: their results are never stored)
    for the 32-value group whose two 16-value pieces sit at BLOCKED positions piece0 and piece0 + nblk,
    and the group's dx, Σx - dx·Σxq and Σx [16] (kept with its first piece)."""
    m = tl.minimum(m0 + tl.arange(0, 16), M - 1).to(tl.int64)
    c = tl.arange(0, 32)
    x = tl.load(xq8 + m[:, None] * K + ((piece0 + (c // 16) * nblk) * 16 + c % 16)[None, :])
    stats = act + (m * (K // 16) + piece0) * 4
    return x, tl.load(stats), tl.load(stats + 2), tl.load(stats + 3)


@triton.jit
def _q4k_words(w32, row_q, t, nblk, g: tl.constexpr):
    """Nibble words 8g.. [BN, 8] of Q4_K block t (quads 1 + 2g and 2 + 2g): byte l holds value 64g + l in its
    low nibble and 64g + 32 + l in its high one."""
    w = tl.arange(0, 8)
    quad = (1 + 2 * g + w // 4) * nblk + t
    return tl.load(w32 + (row_q[:, None] + quad[None, :]) * 4 + (w % 4)[None, :])


@triton.jit
def _as_bytes(words):
    """int32 words [BN, W] as int8 [BN, 4W] (byte b of word w at 4w + b): a reinterpretation, which the
    compiler folds back into the words that hold them."""
    b0 = words.to(tl.int8)
    b1 = (words >> 8).to(tl.int8)
    b2 = (words >> 16).to(tl.int8)
    b3 = (words >> 24).to(tl.int8)
    both = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [BN, W, 2, 2]: byte 2p + q at [p, q]
    return tl.reshape(both, (words.shape[0], 4 * words.shape[1]))


@triton.jit
def _centred_nibbles(words, h: tl.constexpr):
    """Nibble h of every byte of words [BN, 8], centred and in the high half: int8 [BN, 32] of 16·(q - 8)
    (q ^ 8 is q - 8 as a signed nibble), two bit operations per four values."""
    if h == 0:
        words = words << 4
    return _as_bytes((words & -0x0F0F0F10) ^ -0x7F7F7F80)  # & 0xF0F0F0F0, ^ 0x80808080


@triton.jit
def _scaled(acc, dot, dx, sx, dsc16, c):
    """acc + d·sc·dx·Σ(q - 8)·xq + (8·d·sc - dmin·m)·Σx for one group [16, BN] (dot holds 16·Σ(q - 8)·xq,
    dsc16 = d·sc / 16, c = 8·d·sc - dmin·m)."""
    t = dot.to(tl.float32) * dx[:, None]
    return acc + t * dsc16[None, :] + sx[:, None] * c[None, :]


@triton.jit
def _chunk(acc, xq8, act, m0, M, K, piece0, nblk, wq, dsc16, c):
    x, dx, _, sx = _x_group(xq8, act, m0, M, K, piece0, nblk)
    dot = tl.dot(x, wq, out_dtype=tl.int32)
    return _scaled(acc, dot, dx, sx, dsc16, c)


@triton.jit(do_not_specialize=["M"])  # one build for every row count: a new count must not compile mid-serve
def _mmq_kernel(xq8, act, w32, out_ptr, M, N, K, row_stride, nblk, tiles_per_split, n_tiles,
                CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program: BLOCK_N weight rows times CHUNKS x 16 activation rows over one split of K."""
    rows, row_ok, row_q, m0, split, first, last = program_block(N, row_stride, tiles_per_split, n_tiles, CHUNKS,
                                                                 BLOCK_N)
    acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)  # one accumulator per 16 activation rows
    acc1, acc2, acc3 = acc0, acc0, acc0
    for t in range(first, last):
        header = w32 + (row_q + t) * 4  # quad 0 of block t: f16 d and dmin, then the 12 scale bytes
        h0 = tl.load(header)
        h1 = tl.load(header + 1)
        h2 = tl.load(header + 2)
        h3 = tl.load(header + 3)
        d = f16_bits(h0)
        dmin = f16_bits(h0 >> 16)
        for g in tl.static_range(4):
            words = _q4k_words(w32, row_q, t, nblk, g)
            for h in tl.static_range(2):
                wq = tl.trans(_centred_nibbles(words, h))
                sc, mn = _scale_min(h1, h2, h3, 2 * g + h)
                dsc = d * sc
                dsc16 = dsc * 0.0625
                c = 8.0 * dsc - dmin * mn
                piece0 = 2 * (2 * g + h) * nblk + t
                acc0 = _chunk(acc0, xq8, act, m0, M, K, piece0, nblk, wq, dsc16, c)
                if CHUNKS > 1:
                    acc1 = _chunk(acc1, xq8, act, m0 + 16, M, K, piece0, nblk, wq, dsc16, c)
                if CHUNKS > 2:
                    acc2 = _chunk(acc2, xq8, act, m0 + 32, M, K, piece0, nblk, wq, dsc16, c)
                    acc3 = _chunk(acc3, xq8, act, m0 + 48, M, K, piece0, nblk, wq, dsc16, c)
    store_chunks(out_ptr, acc0, acc1, acc2, acc3, split, m0, M, N, rows, row_ok, CHUNKS)


def quant_mmq(x: torch.Tensor | Int8Rows, raw: torch.Tensor, qtype: str, n: int, out_dtype: torch.dtype | None = None,
              cfg: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (or its BLOCKED Int8Rows) times quantized rows raw [N, row_words] (interleaved K-quant rows)
    -> [M, N] in x's dtype (out_dtype for Int8Rows), fp32 accumulation."""
    if qtype not in TYPES:
        raise ValueError(f"the int8 tensor-core kernel multiplies {', '.join(TYPES)}, not {qtype}")
    if isinstance(x, Int8Rows):
        rows8 = x
        out_dtype = out_dtype or torch.float32
    else:
        out_dtype = out_dtype or x.dtype
        rows8 = quantize_rows(x, blocked=True)
    if not rows8.blocked:
        raise ValueError("K-quant weights read BLOCKED int8 rows (quantize_rows(..., blocked=True))")
    m, k = rows8.xq.shape[0], rows8.xq.shape[1] * 4
    check_layout(raw, qtype, k)
    row_stride, nblk, n_tiles = _geometry(qtype, k)
    block_n, warps, split = cfg or config(n, k)
    per_split = triton.cdiv(n_tiles, split)
    split = triton.cdiv(n_tiles, per_split)  # no split left without tiles
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else out_dtype, device=raw.device)
    flat = raw.view(-1)
    c = chunks(m)
    grid = (triton.cdiv(m, 16 * c), triton.cdiv(n, block_n), split)
    _mmq_kernel[grid](rows8.xq.view(torch.int8), rows8.act, flat, out, m, n, k, row_stride,
                      nblk, per_split, n_tiles, CHUNKS=c, BLOCK_N=block_n, num_warps=warps)
    if split == 1:
        return out[0]
    return out.sum(0).to(out_dtype)
