"""Triton dequantization of GGUF blocks to bf16/fp32 for many rows (prefill multiplies the result on
tensor cores). Decode rows (up to 16) go through quant_dp4a_triton.

Every kernel walks a weight row in tiles of 256 values: one K-quant super-block, or eight 32-value
Q8_0/Q4_0 blocks. Layouts follow ggml's block structs byte for byte; the f16 fields are read through
a float16 view of the same bytes (every block size and field offset is even).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q.kernels.quant_fields_triton import kquant_scale_min, u8

QTYPE_ID = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
TILE = 256


@triton.jit
def dequant_tile(w8, w16, row_base, row_ok, t, nblk, QTYPE: tl.constexpr):
    """fp32 values [BLOCK_N, 256] of tile t of each row; row_base: int64 byte offset of each row."""
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
        # bits (bit s of byte l for sub-block s) before the nibbles
        BB: tl.constexpr = 144 if QTYPE == 2 else 176
        QS: tl.constexpr = 16 if QTYPE == 2 else 48
        mask = row_ok[:, None]
        base = row_base[:, None] + t * BB
        d = tl.load(w16 + base // 2, mask=mask, other=0).to(tl.float32)
        dmin = tl.load(w16 + base // 2 + 1, mask=mask, other=0).to(tl.float32)
        sc, mn = kquant_scale_min(w8, base, e // 32, mask)
        qoff = (32 * (e // 64) + e % 32)[None, :]
        q = (u8(w8, base + QS + qoff, mask) >> (4 * ((e // 32) % 2))[None, :]) & 15
        if QTYPE == 3:
            q += ((u8(w8, base + 16 + (e % 32)[None, :], mask) >> (e // 32)[None, :]) & 1) << 4
        return d * sc * q.to(tl.float32) - dmin * mn
    else:  # Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d
        mask = row_ok[:, None]
        base = row_base[:, None] + t * 210
        half, r = e // 128, e % 128
        j, l = r // 32, r % 32
        lo = (u8(w8, base + (64 * half + l + 32 * (j % 2))[None, :], mask) >> (4 * (j // 2))[None, :]) & 15
        hi = (u8(w8, base + 128 + (32 * half + l)[None, :], mask) >> (2 * j)[None, :]) & 3
        sc = tl.load(w8 + base + 192 + (e // 16)[None, :], mask=mask, other=0).to(tl.int8, bitcast=True)
        d = tl.load(w16 + base // 2 + 104, mask=mask, other=0).to(tl.float32)
        return d * sc.to(tl.float32) * ((lo | (hi << 4)) - 32).to(tl.float32)


@triton.jit
def _dequant_kernel(w8, w16, out_ptr, N, K, row_bytes, nblk, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n, t = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w = dequant_tile(w8, w16, rows.to(tl.int64) * row_bytes, row_ok, t, nblk, QTYPE)
    k = t * 256 + tl.arange(0, 256)
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * K + k[None, :]
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (k < K)[None, :])


def _geometry(qtype: str, k: int) -> tuple[int, int, int]:
    elems = 32 if qtype in ("Q8_0", "Q4_0") else 256
    nblk = k // elems
    return nblk * BLOCK_BYTES[qtype], nblk, triton.cdiv(k, TILE)


def dequantize(raw: torch.Tensor, qtype: str, rows: int, k: int, out: torch.Tensor) -> torch.Tensor:
    """Write the values of quantized rows raw [rows, row_bytes] into out [rows, k] (any float dtype)."""
    rb, nblk, n_tiles = _geometry(qtype, k)
    flat = raw.view(-1)
    block_n = 8
    _dequant_kernel[(triton.cdiv(rows, block_n), n_tiles)](flat, flat.view(torch.float16), out, rows, k, rb, nblk,
                                                           QTYPE=QTYPE_ID[qtype], BLOCK_N=block_n, num_warps=4)
    return out
