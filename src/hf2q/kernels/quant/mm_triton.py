"""GGUF-quantized weights times a few activation rows (batched decode) on tensor cores.

Between the one-row int8 mat-vec (quant_dp4a_triton) and prefill's dequantize-then-cuBLAS
(quant_triton.dequantize), a batch of 2-64 rows wants the weight read once, as blocks: each program
dequantizes a [BLOCK_N, 256] tile of weight rows in registers (the same `dequant_tile` the prefill
dequantization uses) and multiplies it with the [BLOCK_M, 256] activation tile on tensor cores, so the
step costs one pass over the quantized bytes however many rows share it (the Marlin approach, with the
blocks in the layout the other kernels read). Few weight rows with a long K split K over programs; the
fp32 partial sums are added in a fixed order, so a row's result depends on the weight's shape and the
configuration, never on the other rows of the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q.kernels.quant.dequant_triton import QTYPE_ID, _geometry, check_layout, dequant_tile

PROGRAMS = 264  # about two programs per SM of the largest cards: split K until the grid has this many


@triton.jit
def _x_tile(x_ptr, m0, M, x_stride, k, K):
    """[16, 256] activation tile: rows m0.., columns k."""
    m = m0 + tl.arange(0, 16)
    return tl.load(x_ptr + m.to(tl.int64)[:, None] * x_stride + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :],
                   other=0)


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 activations (tests, CPU): no tf32 rounding
        return acc + tl.dot(x, w, input_precision="ieee")
    return acc + tl.dot(x, w.to(x.dtype))


@triton.jit
def _store(out_ptr, acc, split, m0, M, N, rows, row_ok):
    m = m0 + tl.arange(0, 16)
    out = out_ptr + (split * M + m).to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(m < M)[:, None] & row_ok[None, :])


@triton.jit
def _quant_mm_kernel(x_ptr, w8, w16, w32, out_ptr, M, N, K, x_stride, row_stride, nblk, tiles_per_split,
                     n_tiles, QTYPE: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """A program: BLOCK_N weight rows times CHUNKS x 16 activation rows over one split of K. Each chunk of 16
    rows is its own dot with its own accumulator, so a row's sums never depend on how many rows a program
    takes."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_base = rows.to(tl.int64) * row_stride
    m0 = pid_m * CHUNKS * 16
    acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, n_tiles)
    for t in range(first, last):
        w = tl.trans(dequant_tile(w8, w16, w32, row_base, row_ok, t, nblk, QTYPE))  # [256, BLOCK_N] fp32
        k = t * 256 + tl.arange(0, 256)
        acc0 = _dot(_x_tile(x_ptr, m0, M, x_stride, k, K), w, acc0, IEEE)
        if CHUNKS > 1:
            acc1 = _dot(_x_tile(x_ptr, m0 + 16, M, x_stride, k, K), w, acc1, IEEE)
        if CHUNKS > 2:
            acc2 = _dot(_x_tile(x_ptr, m0 + 32, M, x_stride, k, K), w, acc2, IEEE)
            acc3 = _dot(_x_tile(x_ptr, m0 + 48, M, x_stride, k, K), w, acc3, IEEE)
    _store(out_ptr, acc0, split, m0, M, N, rows, row_ok)
    if CHUNKS > 1:
        _store(out_ptr, acc1, split, m0 + 16, M, N, rows, row_ok)
    if CHUNKS > 2:
        _store(out_ptr, acc2, split, m0 + 32, M, N, rows, row_ok)
        _store(out_ptr, acc3, split, m0 + 48, M, N, rows, row_ok)


def chunks(m: int) -> int:
    """16-row chunks of activations a program takes: all rows up to 64 (the weight tile is dequantized
    once for them)."""
    return 1 if m <= 16 else 2 if m <= 32 else 4


def config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, warps, splits of K) for an [n, k] weight; it depends on the weight alone, so every row of
    a batch is computed the same way whatever the batch."""
    block_n = 32
    n_tiles = triton.cdiv(k, 256)
    blocks = triton.cdiv(n, block_n)
    split = max(1, min(n_tiles, PROGRAMS // blocks, 16))
    return block_n, 8, split


def quant_mm(x: torch.Tensor, raw: torch.Tensor, qtype: str, n: int, cfg: tuple[int, int, int] | None = None,
             ) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) times quantized rows raw [N, row_bytes] (K-quants: interleaved int32 rows)
    -> [M, N] in x's dtype, fp32 accumulation."""
    m, k = x.shape
    check_layout(raw, qtype, k)
    x = x.contiguous()
    row_stride, nblk, n_tiles = _geometry(qtype, k)
    block_n, warps, split = cfg or config(n, k)
    per_split = triton.cdiv(n_tiles, split)
    split = triton.cdiv(n_tiles, per_split)  # no split left without tiles
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    flat = raw.view(-1)
    w8, w16 = flat.view(torch.uint8), flat.view(torch.float16)
    c = chunks(m)
    grid = (triton.cdiv(m, 16 * c), triton.cdiv(n, block_n), split)
    _quant_mm_kernel[grid](x, w8, w16, flat if raw.dtype == torch.int32 else w16, out, m, n, k, x.stride(0),
                           row_stride, nblk, per_split, n_tiles, QTYPE=QTYPE_ID[qtype], CHUNKS=c,
                           BLOCK_N=block_n, IEEE=x.dtype == torch.float32, num_warps=warps)
    if split == 1:
        return out[0]
    return out.sum(0).to(x.dtype)
