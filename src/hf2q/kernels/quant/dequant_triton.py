"""Triton dequantization of GGUF blocks to bf16/fp32 for many rows (prefill multiplies the result on
tensor cores). Decode rows (up to 16) go through quant_dp4a_triton.

Every kernel walks a weight row in tiles of 256 values: one K-quant super-block, or eight 32-value
Q8_0/Q4_0 blocks. Q8_0 and Q4_0 follow ggml's block structs byte for byte (the f16 fields are read
through a float16 view of the same bytes: every block size and field offset is even); K-quants are
kept on the GPU as interleaved rows (hf2q.quant.to_gpu_rows says why).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q.kernels.quant.fields_triton import f16_bits, kquant_scale_min, u8
from hf2q.quant import KQUANTS, gpu_row_words, kept_row

QTYPE_ID = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
TILE = 256


@triton.jit
def dequant_tile(w8, w16, w32, row_base, row_ok, t, nblk, QTYPE: tl.constexpr):
    """fp32 values [BLOCK_N, 256] of tile t of each row; row_base: int64 offset of each row (bytes; K-quants:
    16-byte quads)."""
    e = tl.arange(0, 256)
    if QTYPE == 0:  # Q8_0: f16 d, 32 x int8
        b = t * 8 + e // 32
        mask = row_ok[:, None] & (b < nblk)[None, :]
        base = row_base[:, None] + (b * 34)[None, :]
        d = tl.load(w16 + base // 2, mask=mask, other=0).to(tl.float32)
        q = tl.load(w8 + base + 2 + (e % 32)[None, :], mask=mask, other=0).to(tl.int8, bitcast=True)
        return d * q.to(tl.float32)
    elif QTYPE == 1:  # Q4_0: f16 d, 16 bytes; value i is nibble (i // 16) of byte i % 16, minus 8
        b = t * 8 + e // 32
        mask = row_ok[:, None] & (b < nblk)[None, :]
        base = row_base[:, None] + (b * 18)[None, :]
        d = tl.load(w16 + base // 2, mask=mask, other=0).to(tl.float32)
        i = e % 32
        q = (u8(w8, base + 2 + (i % 16)[None, :], mask) >> ((i // 16) * 4)[None, :]) & 15
        return d * (q - 8).to(tl.float32)
    elif QTYPE <= 3:  # Q4_K: f16 d, f16 dmin, 12 scale bytes, 128 bytes of nibbles; Q5_K: 32 bytes of fifth
        # bits (bit s of byte l for sub-block s) before the nibbles. Interleaved rows (row_base in quads).
        # Value 64g + 32h + l is nibble h of byte 32g + l of the nibbles, in sub-block s = 2g + h. The bytes
        # are read as whole 16-byte quads ([rows, quad, word]) and split in registers: 8 vector loads a row
        # instead of a byte load per value.
        QS: tl.constexpr = 1 if QTYPE == 2 else 3  # first quad of nibbles
        mask = row_ok[:, None]
        base = _quad_byte(row_base[:, None], 0, nblk, t, 0)  # the block's header quad
        d = tl.load(w16 + base // 2, mask=mask, other=0).to(tl.float32)
        dmin = tl.load(w16 + base // 2 + 1, mask=mask, other=0).to(tl.float32)
        sc, mn = kquant_scale_min(w8, base, tl.arange(0, 8), mask)  # [rows, 8] by sub-block
        sc = tl.reshape(sc, (sc.shape[0], 4, 2, 1))
        mn = tl.reshape(mn, (mn.shape[0], 4, 2, 1))
        q = _quad_bytes(w32, row_base, QS, 8, nblk, t, row_ok)  # [rows, 128]
        g_h = (2 * tl.arange(0, 4)[:, None] + tl.arange(0, 2)[None, :])[None, :, :, None]  # s = 2g + h
        q = (tl.reshape(q, (q.shape[0], 4, 1, 32)) >> (4 * (g_h % 2))) & 15  # [rows, g, h, l]
        if QTYPE == 3:
            hi = _quad_bytes(w32, row_base, 1, 2, nblk, t, row_ok)
            hi = tl.reshape(hi, (hi.shape[0], 1, 1, 32))
            q += ((hi >> g_h) & 1) << 4
        value = d[:, :, None, None] * sc * q.to(tl.float32) - dmin[:, :, None, None] * mn
        return tl.reshape(value, (value.shape[0], 256))
    else:  # Q6_K in interleaved rows (row_base in quads). Value 128h + 32j + l, l = 4w + b: low nibble in
        # byte b of ql word 16h + 8(j % 2) + w of the block, shifted by 4(j // 2); top bits in byte b of qh
        # word 8h + w, shifted by 2j; scale 8h + 2j + w // 4. So each (h, j, w) reads one ql, one qh and one
        # scale word for its four values.
        mask = row_ok[:, None]
        row = row_base[:, None]
        v = tl.arange(0, 64)
        h, j, w = v // 32, (v // 8) % 4, v % 8
        ql = tl.load(w32 + _block_word(row, 16 * h + 8 * (j % 2) + w, nblk, t), mask=mask, other=0)
        qh = tl.load(w32 + _block_word(row, 32 + 8 * h + w, nblk, t), mask=mask, other=0)
        sw = tl.load(w32 + _block_word(row, 48 + 2 * h + j // 2, nblk, t), mask=mask, other=0)
        dw = tl.load(w32 + row_base * 4 + 52 * nblk + t // 2, mask=row_ok, other=0)  # the plane of d
        d = f16_bits(dw >> (16 * (t % 2)))[:, None]
        sc = (sw << (24 - 8 * (2 * (j % 2) + w // 4))[None, :]) >> 24  # signed byte
        b = 8 * tl.arange(0, 4)[None, None, :]
        lo = (ql[:, :, None] >> (b + (4 * (j // 2))[None, :, None])) & 15
        hi = (qh[:, :, None] >> (b + (2 * j)[None, :, None])) & 3
        q = (sc[:, :, None] * ((lo | (hi << 4)) - 32)).to(tl.float32)
        return d * tl.reshape(q, (q.shape[0], 256))


@triton.jit
def _quad_bytes(w32, row_q, first, QUADS: tl.constexpr, nblk, t, row_ok):
    """Bytes [rows, 16 * QUADS] (int32) of quads first.. of block t in interleaved rows starting at quad
    row_q [rows]; each quad one 16-byte load."""
    quad = (first + tl.arange(0, QUADS))[None, :, None]
    word = tl.arange(0, 4)[None, None, :]
    words = tl.load(w32 + (row_q[:, None, None] + quad * nblk + t) * 4 + word, mask=row_ok[:, None, None], other=0)
    shift = (8 * tl.arange(0, 4))[None, None, None, :]
    return tl.reshape((words[:, :, :, None] >> shift) & 255, (words.shape[0], 16 * QUADS))


@triton.jit
def _quad_byte(row_q, quad, nblk, t, byte):
    """Byte offset of byte `byte` of quad `quad` of block t in interleaved rows starting at quad row_q."""
    return (row_q + quad * nblk + t) * 16 + byte


@triton.jit
def _block_word(row_q, word, nblk, t):
    """Word offset of word `word` (of the 13 quads before d) of Q6_K block t in interleaved rows [BN, 1]."""
    return (row_q + ((word // 4) * nblk + t)[None, :]) * 4 + (word % 4)[None, :]


@triton.jit
def _dequant_kernel(w8, w16, w32, out_ptr, N, K, row_stride, nblk, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n, t = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w = dequant_tile(w8, w16, w32, rows.to(tl.int64) * row_stride, row_ok, t, nblk, QTYPE)
    k = t * 256 + tl.arange(0, 256)
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * K + k[None, :]
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (k < K)[None, :])


def _geometry(qtype: str, k: int) -> tuple[int, int, int]:
    """(row stride in the kernel's unit: bytes, or 16-byte quads for K-quants; blocks a row; tiles)."""
    elems = 32 if qtype in ("Q8_0", "Q4_0") else 256
    nblk = k // elems
    stride = gpu_row_words(qtype, k) // 4 if qtype in KQUANTS else nblk * BLOCK_BYTES[qtype]
    return stride, nblk, triton.cdiv(k, TILE)


def check_layout(raw: torch.Tensor, qtype: str, k: int) -> None:
    """Refuse blocks in the layout these kernels do not read: K-quants as interleaved int32 rows
    (hf2q.quant.keep_blocks), Q8_0 and Q4_0 as ggml's uint8 bytes, rows of k values."""
    interleaved = qtype in KQUANTS
    want = kept_row(qtype, k, interleaved)
    if (raw.dtype, raw.shape[-1]) != want:
        layout = "interleaved int32 rows (hf2q.quant.keep_blocks)" if interleaved else "ggml's uint8 bytes"
        raise ValueError(f"the Triton {qtype} kernels read {layout} of {want[1]} a row of {k} values; "
                         f"got {raw.dtype} {tuple(raw.shape)}")


def dequantize(raw: torch.Tensor, qtype: str, rows: int, k: int, out: torch.Tensor) -> torch.Tensor:
    """Write the values of quantized rows raw [rows, row_bytes] (K-quants: interleaved int32 rows) into out [rows, k]
    (any float dtype)."""
    check_layout(raw, qtype, k)
    stride, nblk, n_tiles = _geometry(qtype, k)
    flat = raw.view(-1)
    w8, w16 = flat.view(torch.uint8), flat.view(torch.float16)
    block_n = 8
    _dequant_kernel[(triton.cdiv(rows, block_n), n_tiles)](w8, w16, flat if qtype in KQUANTS else w16, out, rows, k,
                                                           stride, nblk, QTYPE=QTYPE_ID[qtype], BLOCK_N=block_n,
                                                           num_warps=4)
    return out
