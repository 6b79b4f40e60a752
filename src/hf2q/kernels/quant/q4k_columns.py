"""Q4_K weights laid out by column for batched decode (up to 64 activation rows), and the Triton kernel that reads
them.

The tile kernel (mm_triton) reads the blocks in the layout every other kernel reads: a program takes a few weight
rows and walks each one's 144-byte blocks, unpacking 6-bit scale fields and putting nibbles back in order. Here a
Q4_K weight [N, K] is laid out once more, for this kernel alone, so that a program's loads are wide rows along N
and its unpacking is one shift and one mask a value:

- codes: int32 [K/8, N]. In each 256-value tile t of K, word (32 t + j, n) holds in nibble s the code of
  k = 256 t + 32 s + j: nibble s of a tile's 32 words is its sub-block s, in order.
- scales: int16 [K/32, N], the sub-block's 6-bit scale | 6-bit min << 8; d, dmin: fp16 [K/256, N].

A value is d * scale * code - dmin * min in fp32 (one rounding, as ggml's dequantization), rounded to the
activations' dtype (as the dense copy is), and the sub-block's 32 values are multiplied on tensor cores against
the matching 32 columns of the activations. The layout is 4.63 bits a value (Q4_K's 4.5, plus the scale fields
unpacked); it is kept beside the blocks, which the 1-4 row mat-vec reads.

Every 16 activation rows have their own dot and accumulator (`CHUNKS`), and K is split over programs by the
weight's shape alone, the split partials added in a fixed order: a row's result does not depend on the other rows
of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# K is split until the grid has about PROGRAMS programs, in at most MAX_SPLIT parts: on an H100 at 16 rows the 9B's
# Q4_K shapes were fastest so (of 1, 4 and 16 parts: 4 for the 4096-row weights and attention's q+k, 1 for the
# 24576-row gate+up; BENCHMARKS.md), where more parts cost more in the partial sums than a fuller grid gains.
PROGRAMS = 600
MAX_SPLIT = 4


@dataclass
class Q4KColumns:
    """A Q4_K weight [n, k] in this module's layout (see above)."""
    codes: torch.Tensor   # int32 [k / 8, n]
    scales: torch.Tensor  # int16 [k / 32, n]: scale | min << 8
    d: torch.Tensor       # fp16 [k / 256, n]
    dmin: torch.Tensor    # fp16 [k / 256, n]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[1], self.codes.shape[0] * 8

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.d, self.dmin))


def from_blocks(raw: torch.Tensor, n: int) -> Q4KColumns:
    """ggml-order Q4_K rows, uint8 [n, k / 256 * 144] (on any device), laid out by column, in torch ops on that
    device. Fields as ggml's get_scale_min_k4 reads them; the result dequantizes to exactly ggml's values."""
    blocks = raw.reshape(n, -1, 144)
    nb = blocks.shape[1]
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    dmin = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    f = blocks[..., 4:16].to(torch.int32)  # the 12-byte scale field
    scale = torch.cat([f[..., 0:4] & 63, (f[..., 8:12] & 15) | ((f[..., 0:4] >> 6) << 4)], -1)  # [n, nb, 8]
    mins = torch.cat([f[..., 4:8] & 63, (f[..., 8:12] >> 4) | ((f[..., 4:8] >> 6) << 4)], -1)
    qs = blocks[..., 16:].to(torch.int32).view(n, nb, 4, 1, 32)  # pair i: low nibbles sub-block 2i, high 2i + 1
    codes = torch.cat([qs & 15, qs >> 4], 3).view(n, nb, 8, 32)  # [n, tile, sub-block s, j]
    words = codes[:, :, 0]
    for s in range(1, 8):
        words = words | (codes[:, :, s] << (4 * s))  # int32: nibble 7's bits wrap into the sign, as stored
    return Q4KColumns(codes=words.reshape(n, nb * 32).t().contiguous(),
                      scales=(scale | (mins << 8)).reshape(n, nb * 8).t().contiguous().to(torch.int16),
                      d=d.t().contiguous(), dmin=dmin.t().contiguous())


def dequantize(cols: Q4KColumns) -> torch.Tensor:
    """fp32 values [n, k] of a laid-out weight (the reference of the kernel's operands; tests)."""
    n, k = cols.shape
    words = cols.codes.t().reshape(n, k // 256, 1, 32)
    codes = (words >> (4 * torch.arange(8, device=words.device).view(1, 1, 8, 1))) & 15  # [n, tile, s, j]
    fields = cols.scales.t().to(torch.int32) & 0xFFFF
    scale = cols.d.t().float().repeat_interleave(8, 1) * (fields & 255).float()
    mins = cols.dmin.t().float().repeat_interleave(8, 1) * (fields >> 8).float()
    return (codes.reshape(n, k // 32, 32).float() * scale[..., None] - mins[..., None]).reshape(n, k)


@triton.jit
def _chunk_dot(acc, x_ptr, rows, stride_x, M, k0, j, v, IEEE: tl.constexpr):
    """acc + x[rows, k0 + j] @ v for one 16-row chunk (rows past M read as zero). IEEE: fp32 activations (tests,
    CPU), multiplied without tf32 rounding."""
    x = tl.load(x_ptr + rows[:, None] * stride_x + (k0 + j)[None, :], mask=rows[:, None] < M, other=0.0)
    if IEEE:
        return acc + tl.dot(x, v, input_precision="ieee")
    return acc + tl.dot(x, v)


@triton.jit
def _q4k_columns_kernel(x_ptr, codes_ptr, scales_ptr, d_ptr, dmin_ptr, out_ptr, M, N, stride_x, tiles_per_split,
                        n_tiles, BN: tl.constexpr, CHUNKS: tl.constexpr, IEEE: tl.constexpr = False):
    """Program (row block, column block, split): BN weight columns over its split's 256-value tiles, for up to
    16 * CHUNKS activation rows, each 16-row chunk its own dot and accumulator."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    r = pid_m * 16 * CHUNKS + tl.arange(0, 16)
    j = tl.arange(0, 32)
    acc0 = tl.zeros((16, BN), tl.float32)
    acc1 = tl.zeros((16, BN), tl.float32)
    acc2 = tl.zeros((16, BN), tl.float32)
    acc3 = tl.zeros((16, BN), tl.float32)
    first = pid_s * tiles_per_split
    for t in range(first, tl.minimum(first + tiles_per_split, n_tiles)):
        words = tl.load(codes_ptr + (t * 32 + j)[:, None] * N + cols[None, :], mask=col_ok[None, :], other=0)
        words = words.to(tl.uint32, bitcast=True)
        d = tl.load(d_ptr + t * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        dmin = tl.load(dmin_ptr + t * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        for s in tl.static_range(8):
            field = tl.load(scales_ptr + (t * 8 + s) * N + cols, mask=col_ok, other=0).to(tl.int32)
            scale = (field & 255).to(tl.float32) * d
            mins = ((field >> 8) & 255).to(tl.float32) * dmin
            v = ((words >> (4 * s)) & 15).to(tl.float32) * scale[None, :] - mins[None, :]
            v = v.to(x_ptr.dtype.element_ty)
            k0 = t * 256 + s * 32
            acc0 = _chunk_dot(acc0, x_ptr, r, stride_x, M, k0, j, v, IEEE)
            if CHUNKS > 1:
                acc1 = _chunk_dot(acc1, x_ptr, r + 16, stride_x, M, k0, j, v, IEEE)
            if CHUNKS > 2:
                acc2 = _chunk_dot(acc2, x_ptr, r + 32, stride_x, M, k0, j, v, IEEE)
                acc3 = _chunk_dot(acc3, x_ptr, r + 48, stride_x, M, k0, j, v, IEEE)
    out = out_ptr + pid_s * M * N + cols[None, :]
    tl.store(out + r[:, None] * N, acc0.to(out_ptr.dtype.element_ty), mask=(r[:, None] < M) & col_ok[None, :])
    if CHUNKS > 1:
        tl.store(out + (r + 16)[:, None] * N, acc1.to(out_ptr.dtype.element_ty),
                 mask=((r + 16)[:, None] < M) & col_ok[None, :])
    if CHUNKS > 2:
        tl.store(out + (r + 32)[:, None] * N, acc2.to(out_ptr.dtype.element_ty),
                 mask=((r + 32)[:, None] < M) & col_ok[None, :])
        tl.store(out + (r + 48)[:, None] * N, acc3.to(out_ptr.dtype.element_ty),
                 mask=((r + 48)[:, None] < M) & col_ok[None, :])


def chunks(m: int) -> int:
    """16-row chunks a program takes: every row up to 64, so each weight value is made once for all of them."""
    return 1 if m <= 16 else 2 if m <= 32 else 4


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BN, warps, pipeline stages, splits of K) for an [n, k] weight: the weight's shape alone decides, so every
    row of a batch is computed the same way whatever the batch."""
    block_n = 64
    n_tiles = k // 256
    split = max(1, min(n_tiles, PROGRAMS // triton.cdiv(n, block_n), MAX_SPLIT))
    return block_n, 4, 3, split


def columns_mm(x: torch.Tensor, cols: Q4KColumns, cfg: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= 64) times the laid-out weight [N, K] transposed -> [M, N] in x's dtype, fp32 sums."""
    m, k = x.shape
    n, kw = cols.shape
    if kw != k or m > 64:
        raise ValueError(f"columns_mm takes up to 64 rows of {kw} values, got {tuple(x.shape)}")
    x = x.contiguous()
    block_n, warps, stages, split = cfg or config(n, k)
    n_tiles = k // 256
    per_split = triton.cdiv(n_tiles, split)
    split = triton.cdiv(n_tiles, per_split)
    c = chunks(m)
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(m, 16 * c), triton.cdiv(n, block_n), split)
    _q4k_columns_kernel[grid](x, cols.codes, cols.scales, cols.d, cols.dmin, out, m, n, x.stride(0), per_split,
                              n_tiles, BN=block_n, CHUNKS=c, IEEE=x.dtype == torch.float32, num_warps=warps,
                              num_stages=stages)
    return out[0] if split == 1 else out.sum(0).to(x.dtype)
