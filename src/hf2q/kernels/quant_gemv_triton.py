"""Triton mat-vec reading GGUF blocks directly, built to move weight bytes at the memory's speed.

Decode multiplies one activation row by every weight row, so the kernel's only job is to stream the
blocks: each program owns BLOCK_N weight rows and walks them SB blocks at a time. Quantized values are
loaded as whole contiguous byte runs (16-byte vector loads where the block size allows), multiplied by
the matching activations, and summed per sub-block before the sub-block's scale is applied; K-quant
mins are applied once per sub-block through the activation's sub-block sum. Nothing is dequantized to
memory. One program column per activation row: with several rows (or MoE token-expert pairs, each its
own expert) the programs of one weight tile run side by side and share it through L2.

Layouts follow ggml's block structs byte for byte (see quant_triton.py); f16 fields are read through a
float16 view of the same bytes.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hf2q.kernels.quant_fields_triton import exact_f32, f16_bits, kquant_scale_min, u8

QTYPE_ID = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_ELEMS = {"Q8_0": 32, "Q4_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


@triton.jit
def _kquant_dots(w8, w16, x_row, row_base, row_ok, u0, n_units, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                 SB: tl.constexpr):
    """Σ over blocks u0 .. u0+SB of Q4_K / Q5_K rows times x, per row [BLOCK_N].

    Tensors are [BLOCK_N, SB*4, 32]: axis 1 walks (block, 64-value chunk c), axis 2 the 32 bytes of
    that chunk's quants; the low nibbles are sub-block 2c, the high nibbles sub-block 2c + 1."""
    BB: tl.constexpr = 144 if QTYPE == 2 else 176
    QS: tl.constexpr = 16 if QTYPE == 2 else 48
    q = tl.arange(0, SB * 4)
    l = tl.arange(0, 32)
    u = u0 + q // 4
    c = q % 4
    u_ok = u < n_units
    mask2 = row_ok[:, None] & u_ok[None, :]
    mask3 = mask2[:, :, None]
    blk = row_base[:, None] + (u * BB)[None, :]  # [BN, Q]
    qs = u8(w8, blk[:, :, None] + (QS + 32 * c)[None, :, None] + l[None, None, :], mask3)
    xo = (u * 256 + 64 * c)[:, None] + l[None, :]  # [Q, 32]
    x0 = tl.load(x_row + xo, mask=u_ok[:, None], other=0).to(tl.float32)
    x1 = tl.load(x_row + xo + 32, mask=u_ok[:, None], other=0).to(tl.float32)
    lo = qs & 15
    hi = qs >> 4
    if QTYPE == 3:  # fifth bit of each value: bit s of byte l of the 32-byte qh field
        qh = u8(w8, blk[:, :, None] + 16 + l[None, None, :], mask3)
        lo += ((qh >> (2 * c)[None, :, None]) & 1) << 4
        hi += ((qh >> (2 * c + 1)[None, :, None]) & 1) << 4
    dot0 = tl.sum(exact_f32(lo, 0.0) * x0[None, :, :], axis=2)  # [BN, Q]
    dot1 = tl.sum(exact_f32(hi, 0.0) * x1[None, :, :], axis=2)
    sum0 = tl.sum(x0, axis=1)[None, :]
    sum1 = tl.sum(x1, axis=1)[None, :]
    sc0, mn0 = kquant_scale_min(w8, blk, 2 * c, mask2)
    sc1, mn1 = kquant_scale_min(w8, blk, 2 * c + 1, mask2)
    d = tl.load(w16 + blk // 2, mask=mask2, other=0).to(tl.float32)
    dmin = tl.load(w16 + blk // 2 + 1, mask=mask2, other=0).to(tl.float32)
    part = d * (sc0 * dot0 + sc1 * dot1) - dmin * (mn0 * sum0 + mn1 * sum1)
    return tl.sum(part, axis=1)


@triton.jit
def _q4k_word_dots(w32, x_row, blk, u, u_ok, mask4, BLOCK_N: tl.constexpr, SB: tl.constexpr):
    """Q4_K quants read as int32 words [BLOCK_N, SB, 4 chunks, 8 words]: byte b of word w of chunk c holds
    values 64c + 4w + b (low nibble, sub-block 2c) and 64c + 32 + 4w + b (high nibble, sub-block 2c + 1).
    Nibble p of a word becomes a float in place: masking it and OR-ing in the exponent of 2**23 gives
    2**23 + q·16**p exactly (nibbles 5..7 are first shifted down 12 bits, clear of the exponent), so no
    per-byte widening
    and no conversion; the power of 16 comes off after the sum. Returns the dots and activation sums of
    sub-blocks 2c and 2c + 1, each [BLOCK_N, SB, 4] / [1, SB, 4]."""
    c = tl.arange(0, 4)
    wi = tl.arange(0, 8)
    words = tl.load(w32 + (blk // 4 + 4)[:, :, None, None] + (8 * c)[None, None, :, None] + wi[None, None, None, :],
                    mask=mask4, other=0)
    high = words >> 12  # nibbles 5..7 moved below bit 23, the first exponent bit
    dot0 = tl.zeros((BLOCK_N, SB, 4), dtype=tl.float32)
    dot1 = tl.zeros((BLOCK_N, SB, 4), dtype=tl.float32)
    sum0 = tl.zeros((SB, 4), dtype=tl.float32)
    sum1 = tl.zeros((SB, 4), dtype=tl.float32)
    for p in tl.static_range(8):
        if p < 5:
            bits = words & (15 << (4 * p))
            unit = 1.0 / (1 << (4 * p))
        else:
            bits = high & (15 << (4 * p - 12))
            unit = 1.0 / (1 << (4 * p - 12))
        f = (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        xo = (u * 256)[:, None, None] + (64 * c + 32 * (p % 2))[None, :, None] + (4 * wi + p // 2)[None, None, :]
        xp = tl.load(x_row + xo, mask=u_ok[:, None, None], other=0).to(tl.float32)  # [SB, 4, 8]
        part = tl.sum(f * xp[None, :, :, :], axis=3) * unit
        if p % 2 == 0:
            dot0 += part
            sum0 += tl.sum(xp, axis=2)
        else:
            dot1 += part
            sum1 += tl.sum(xp, axis=2)
    return dot0, dot1, sum0[None, :, :], sum1[None, :, :]


@triton.jit
def _kquant_dots_blockwise(w8, w32, x_row, row_base, row_ok, u0, n_units, QTYPE: tl.constexpr,
                           BLOCK_N: tl.constexpr, SB: tl.constexpr, WORDS: tl.constexpr):
    """_kquant_dots with tensors [BLOCK_N, SB, 4, 32] (row, block, chunk, byte): each block's 16-byte head
    (d, dmin, 12 scale bytes) is read as four int32 words once, and its eight scales and mins are
    unpacked from them in registers instead of byte by byte. WORDS (Q4_K): quants as int32 words too."""
    BB: tl.constexpr = 144 if QTYPE == 2 else 176
    QS: tl.constexpr = 16 if QTYPE == 2 else 48
    sb = tl.arange(0, SB)
    c = tl.arange(0, 4)
    l = tl.arange(0, 32)
    u = u0 + sb
    u_ok = u < n_units
    mask2 = row_ok[:, None] & u_ok[None, :]  # [BN, SB]
    mask4 = mask2[:, :, None, None]
    blk = row_base[:, None] + (u * BB)[None, :]  # [BN, SB] byte offsets, multiples of 16
    if WORDS:
        dot0, dot1, sum0, sum1 = _q4k_word_dots(w32, x_row, blk, u, u_ok, mask4, BLOCK_N, SB)
    else:
        qs = u8(w8, blk[:, :, None, None] + (QS + 32 * c)[None, None, :, None] + l[None, None, None, :], mask4)
        xo = (u * 256)[:, None, None] + (64 * c)[None, :, None] + l[None, None, :]  # [SB, 4, 32]
        x0 = tl.load(x_row + xo, mask=u_ok[:, None, None], other=0).to(tl.float32)
        x1 = tl.load(x_row + xo + 32, mask=u_ok[:, None, None], other=0).to(tl.float32)
        lo = qs & 15
        hi = qs >> 4
        if QTYPE == 3:  # fifth bit of each value: bit s of byte l of the 32-byte qh field
            qh = u8(w8, blk[:, :, None, None] + 16 + l[None, None, None, :], mask4)
            lo += ((qh >> (2 * c)[None, None, :, None]) & 1) << 4
            hi += ((qh >> (2 * c + 1)[None, None, :, None]) & 1) << 4
        dot0 = tl.sum(exact_f32(lo, 0.0) * x0[None, :, :, :], axis=3)  # [BN, SB, 4]: sub-blocks 2c
        dot1 = tl.sum(exact_f32(hi, 0.0) * x1[None, :, :, :], axis=3)  # sub-blocks 2c + 1
        sum0 = tl.sum(x0, axis=2)[None, :, :]
        sum1 = tl.sum(x1, axis=2)[None, :, :]
    word = blk // 4
    head = tl.load(w32 + word, mask=mask2, other=0)
    d = f16_bits(head)[:, :, None]
    dmin = f16_bits(head >> 16)[:, :, None]
    wa = tl.load(w32 + word + 1, mask=mask2, other=0)[:, :, None]  # scale bytes 0-3
    wb = tl.load(w32 + word + 2, mask=mask2, other=0)[:, :, None]  # 4-7
    wh = tl.load(w32 + word + 3, mask=mask2, other=0)[:, :, None]  # 8-11
    low = (c < 2)[None, None, :]
    acc = tl.zeros((BLOCK_N, SB, 4), dtype=tl.float32)
    for nib in tl.static_range(2):  # sub-block s = 2c + nib; ggml's get_scale_min_k4 with i = s % 4
        shift = (8 * ((2 * c + nib) % 4))[None, None, :]
        a = (wa >> shift) & 255
        b = (wb >> shift) & 255
        h = (wh >> shift) & 255
        sc = tl.where(low, a & 63, (h & 15) | ((a >> 6) << 4)).to(tl.float32)
        mn = tl.where(low, b & 63, (h >> 4) | ((b >> 6) << 4)).to(tl.float32)
        if nib == 0:
            acc += d * sc * dot0 - dmin * mn * sum0
        else:
            acc += d * sc * dot1 - dmin * mn * sum1
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _q6k_dots(w8, w16, x_row, row_base, row_ok, u0, n_units, BLOCK_N: tl.constexpr, SB: tl.constexpr):
    """Σ over blocks u0 .. u0+SB of Q6_K rows times x, per row [BLOCK_N].

    Block: 128 bytes of low nibbles, 64 bytes of 2-bit pairs, 16 int8 scales, f16 d. Value (half, j, l)
    (index 128·half + 32·j + l) has its low nibble in byte 64·half + 32·(j % 2) + l, shifted by 4·(j // 2),
    and its top bits in byte 128 + 32·half + l, shifted by 2·j. Axis 1 walks (block, r = 2·half + j % 2),
    whose 32 low-nibble bytes are contiguous; the two nibbles of each byte are j // 2 = 0 and 1."""
    q = tl.arange(0, SB * 4)
    l = tl.arange(0, 32)
    u = u0 + q // 4
    r = q % 4
    half = r // 2
    jlo = r % 2
    u_ok = u < n_units
    mask2 = row_ok[:, None] & u_ok[None, :]
    mask3 = mask2[:, :, None]
    blk = row_base[:, None] + (u * 210)[None, :]  # [BN, Q]
    ql = u8(w8, blk[:, :, None] + (32 * r)[None, :, None] + l[None, None, :], mask3)
    qh = u8(w8, blk[:, :, None] + (128 + 32 * half)[None, :, None] + l[None, None, :], mask3)
    g = tl.arange(0, SB * 8)  # 16-value groups: (block, half, j % 2, l // 16)
    gu = u0 + g // 8
    gr = g % 8
    gmask = row_ok[:, None] & (gu < n_units)[None, :]
    gblk = row_base[:, None] + (gu * 210)[None, :]
    acc = tl.zeros((BLOCK_N, SB * 8), dtype=tl.float32)
    for jhi in tl.static_range(2):
        j = 2 * jhi + jlo  # [Q]
        val = ((ql >> (4 * jhi)) & 15) | (((qh >> (2 * j)[None, :, None]) & 3) << 4)
        xo = (u * 256 + 128 * half + 32 * j)[:, None] + l[None, :]
        x = tl.load(x_row + xo, mask=u_ok[:, None], other=0).to(tl.float32)
        prod = exact_f32(val, 32.0) * x[None, :, :]  # [BN, Q, 32]
        grp = tl.sum(tl.reshape(prod, (BLOCK_N, SB * 8, 16)), axis=2)  # [BN, SB*8]
        # group gr = 4·half + 2·(j % 2) + l // 16 has scale 8·half + 4·(j // 2) + 2·(j % 2) + l // 16
        sc = tl.load(w8 + gblk + (192 + 8 * (gr // 4) + 4 * jhi + gr % 4)[None, :], mask=gmask, other=0)
        acc += grp * sc.to(tl.int8, bitcast=True).to(tl.float32)
    d = tl.load(w16 + (gblk + 208) // 2, mask=gmask, other=0).to(tl.float32)
    return tl.sum(acc * d, axis=1)


@triton.jit
def _q8_q4_dots(w8, w16, x_row, row_base, row_ok, u0, n_units, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                SB: tl.constexpr):
    """Σ over 32-value blocks u0 .. u0+SB of Q8_0 (f16 d, 32 int8) or Q4_0 (f16 d, 16 bytes: value i is
    nibble i // 16 of byte i % 16, minus 8) rows times x, per row [BLOCK_N]."""
    s = tl.arange(0, SB)
    u = u0 + s
    u_ok = u < n_units
    mask2 = row_ok[:, None] & u_ok[None, :]
    if QTYPE == 0:
        blk = row_base[:, None] + (u * 34)[None, :]
        l = tl.arange(0, 32)
        qv = tl.load(w8 + blk[:, :, None] + 2 + l[None, None, :], mask=mask2[:, :, None], other=0)
        x = tl.load(x_row + (u * 32)[:, None] + l[None, :], mask=u_ok[:, None], other=0).to(tl.float32)
        dot = tl.sum(exact_f32(qv.to(tl.int32) ^ 128, 128.0) * x[None, :, :], axis=2)  # int8 = (u ^ 128) - 128
    else:
        blk = row_base[:, None] + (u * 18)[None, :]
        l = tl.arange(0, 16)
        qv = u8(w8, blk[:, :, None] + 2 + l[None, None, :], mask2[:, :, None])
        xo = (u * 32)[:, None] + l[None, :]
        x0 = tl.load(x_row + xo, mask=u_ok[:, None], other=0).to(tl.float32)
        x1 = tl.load(x_row + xo + 16, mask=u_ok[:, None], other=0).to(tl.float32)
        dot = tl.sum(exact_f32(qv & 15, 8.0) * x0[None, :, :] + exact_f32(qv >> 4, 8.0) * x1[None, :, :], axis=2)
    d = tl.load(w16 + blk // 2, mask=mask2, other=0).to(tl.float32)
    return tl.sum(d * dot, axis=1)


@triton.jit
def _gemv_kernel(x_ptr, w8, w16, w32, out_ptr, expert_ptr, N, row_bytes, n_units, expert_bytes, x_stride,
                 out_stride, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, MODE: tl.constexpr,
                 HAS_EXPERTS: tl.constexpr):
    """out[m, n] = Σ_k x[m, k] · W[n, k]; with experts, row m uses expert expert_ptr[m]'s weight."""
    m = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_base = rows.to(tl.int64) * row_bytes
    if HAS_EXPERTS:
        row_base += tl.load(expert_ptr + m).to(tl.int64) * expert_bytes
    x_row = x_ptr + m.to(tl.int64) * x_stride
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for u0 in range(0, n_units, SB):
        if QTYPE == 4:
            acc += _q6k_dots(w8, w16, x_row, row_base, row_ok, u0, n_units, BLOCK_N, SB)
        elif QTYPE >= 2 and MODE > 0:
            acc += _kquant_dots_blockwise(w8, w32, x_row, row_base, row_ok, u0, n_units, QTYPE, BLOCK_N, SB,
                                          MODE == 2)
        elif QTYPE >= 2:
            acc += _kquant_dots(w8, w16, x_row, row_base, row_ok, u0, n_units, QTYPE, BLOCK_N, SB)
        else:
            acc += _q8_q4_dots(w8, w16, x_row, row_base, row_ok, u0, n_units, QTYPE, BLOCK_N, SB)
    tl.store(out_ptr + m.to(tl.int64) * out_stride + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


# (BLOCK_N, blocks per step, warps, mode) by type, mode 0: bytes; 1: K-quant block heads as int32 words;
# 2: Q4_K quants as words too. The defaults, and the candidates timed on the device at a shape's first
# use (see best_config). 32-value types step over more blocks.
CONFIG = {"Q8_0": (4, 16, 2, 0), "Q4_0": (4, 16, 2, 0), "Q4_K": (4, 4, 2, 0), "Q5_K": (4, 4, 2, 0),
          "Q6_K": (4, 4, 2, 0)}
_K_CANDIDATES = [(4, 4, 2), (2, 4, 1), (2, 8, 2), (4, 8, 2), (8, 4, 4), (4, 2, 2), (1, 8, 1)]
_B_CANDIDATES = [(4, 16, 2), (2, 16, 1), (4, 32, 2), (8, 16, 4), (2, 32, 2)]
_TUNED: dict[tuple, tuple] = {}
_TUNE = (os.environ.get("HF2Q_GEMV_TUNE") or "1") == "1"
if (os.environ.get("HF2Q_GEMV_TUNE") or "1") not in ("0", "1"):
    raise ValueError(f"HF2Q_GEMV_TUNE must be 0 or 1, not {os.environ['HF2Q_GEMV_TUNE']!r}")


def candidates(qtype: str) -> list[tuple[int, int, int, int]]:
    if qtype in ("Q8_0", "Q4_0"):
        return [(*c, 0) for c in _B_CANDIDATES]
    modes = {"Q4_K": (0, 1, 2), "Q5_K": (0, 1)}.get(qtype, (0,))
    return [(*c, mode) for mode in modes for c in _K_CANDIDATES]


def _time(fn, reps: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def best_config(x, raw, qtype: str, n: int, experts) -> tuple[int, int, int, int]:
    """The fastest candidate for this shape, timed once per (type, N, K, rows, experts) on CUDA outside
    graph capture (the capture's warm-up step does it); the default elsewhere, or with HF2Q_GEMV_TUNE=0."""
    if not x.is_cuda or not _TUNE:
        return CONFIG[qtype]
    rows = 1 << (x.shape[0] - 1).bit_length()  # MoE pair counts vary step to step: tune per power of two
    key = (qtype, n, x.shape[1], rows, experts is not None, x.dtype)
    cfg = _TUNED.get(key)
    if cfg is None:
        if torch.cuda.is_current_stream_capturing():
            return CONFIG[qtype]
        timed = []
        for c in candidates(qtype):
            try:
                timed.append((_time(lambda c=c: gemv(x, raw, qtype, n, experts, config=c)), c))
            except Exception:  # noqa: BLE001 - a candidate the compiler rejects is skipped
                continue
        cfg = _TUNED[key] = min(timed)[1] if timed else CONFIG[qtype]
    return cfg


def gemv(x: torch.Tensor, raw: torch.Tensor, qtype: str, n: int, experts: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] times quantized rows raw [(E,) N, row_bytes] -> [M, N] in x's dtype.

    With `experts` [M] (int32), row m of x is multiplied by expert experts[m] of a stacked [E, N, ...] weight.
    """
    x = x.contiguous()
    m, k = x.shape
    n_units = k // BLOCK_ELEMS[qtype]
    rb = n_units * BLOCK_BYTES[qtype]
    block_n, sb, warps, mode = config or best_config(x, raw, qtype, n, experts)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    flat = raw.view(-1)
    words = flat.view(torch.int32) if mode else flat
    _gemv_kernel[(m, triton.cdiv(n, block_n))](
        x, flat, flat.view(torch.float16), words, out, experts if experts is not None else flat, n, rb, n_units,
        n * rb, x.stride(0), out.stride(0), QTYPE=QTYPE_ID[qtype], BLOCK_N=block_n, SB=sb, MODE=mode,
        HAS_EXPERTS=experts is not None, num_warps=warps)
    return out
