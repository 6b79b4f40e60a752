"""Triton mat-vec for GGUF blocks on 8-bit integer dot products (dp4a), for decode's few rows.

A float mat-vec spends a dozen instructions per weight unpacking, converting and multiplying, which
keeps it at a quarter of the memory's speed. Here the activation rows are first quantized to int8 in
32-value groups (scale dx = max|x| / 127, as llama.cpp's q8_1), then each 32-bit word of weights is
unpacked to four bytes with a mask and a shift and multiplied against four activation bytes by one
dp4a instruction. The integer sum of each weight sub-block is scaled once: d · scale · dx. K-quant
mins use the exact float sum of the activations' group; Q6_K's and Q4_0's value offsets (32, 8) use
the integer sum of the quantized group. The only rounding beyond fp32 accumulation is the
activations' int8 quantization (about 0.5% relative per dot product).

BLOCK_M activation rows share each unpacked weight word (batched decode). With `experts`, every row
m has its own expert's weight (MoE token-expert pairs) and BLOCK_M is 1.

Layouts follow ggml's block structs byte for byte (see quant_triton.py). Q4_K and Q5_K blocks are
multiples of 16 bytes and are read as int32 words; Q6_K, Q8_0 and Q4_0 blocks are only 2-byte aligned,
so their words are joined from two 16-bit halves.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hf2q.kernels.quant_fields_triton import f16_bits

QTYPE_ID = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_ELEMS = {"Q8_0": 32, "Q4_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
EMULATE = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter runs no PTX: dp4a in plain integer ops
NIBBLES = tl.constexpr(0x0F0F0F0F)


@triton.jit
def _quantize_kernel(x_ptr, xq_ptr, dx_ptr, sx_ptr, s16_ptr, n_groups, x_stride, GROUPS: tl.constexpr):
    """Row m, groups g: xq = round(x / dx) in int8, dx = max|x| / 127, sx = Σ x, s16 = Σ xq per 16."""
    m = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    l = tl.arange(0, 32)
    ok = g < n_groups
    x = tl.load(x_ptr + m * x_stride + g[:, None] * 32 + l[None, :], mask=ok[:, None], other=0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    v = x * inv[:, None]
    q = tl.minimum(tl.maximum(tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)), -127.0), 127.0).to(tl.int32)
    row = m.to(tl.int64) * n_groups
    tl.store(xq_ptr + row * 32 + g[:, None] * 32 + l[None, :], q.to(tl.int8), mask=ok[:, None])
    tl.store(dx_ptr + row + g, amax / 127.0, mask=ok)
    tl.store(sx_ptr + row + g, tl.sum(x, axis=1), mask=ok)
    halves = tl.sum(tl.reshape(q, (GROUPS, 2, 16)), axis=2)  # [GROUPS, 2]
    h = tl.arange(0, 2)
    tl.store(s16_ptr + 2 * row + 2 * g[:, None] + h[None, :], halves, mask=ok[:, None])


@triton.jit
def _dp4a(a, b, SIGNED: tl.constexpr, EMULATE: tl.constexpr):
    """Σ of the four byte products of int32 words a and b (b's bytes signed; a's signed if SIGNED)."""
    if EMULATE:
        acc = (a & 0) + (b & 0)
        for i in tl.static_range(4):
            bi = (b << (24 - 8 * i)) >> 24
            if SIGNED:
                ai = (a << (24 - 8 * i)) >> 24
            else:
                ai = (a >> (8 * i)) & 255
            acc += ai * bi
        return acc
    else:
        a, b = tl.broadcast(a, b)
        if SIGNED:
            asm: tl.constexpr = "dp4a.s32.s32 $0, $1, $2, $3;"
        else:
            asm: tl.constexpr = "dp4a.u32.s32 $0, $1, $2, $3;"
        return tl.inline_asm_elementwise(asm, "=r,r,r,r", [a, b, a & 0], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _word_from_halves(w16, half, mask):
    """int32 words whose two 16-bit halves are at w16 + half and w16 + half + 1 (2-byte-aligned blocks)."""
    lo = tl.load(w16 + half, mask=mask, other=0).to(tl.int32) & 0xFFFF
    hi = tl.load(w16 + half + 1, mask=mask, other=0).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def _idot(w, xw, SIGNED: tl.constexpr, EMULATE: tl.constexpr):
    """Weight words w [BN, Q, 8] · activation words xw [BM, Q, 8] -> int32 [BM, BN, Q] (sums of 32 bytes)."""
    return tl.sum(_dp4a(w[None, :, :, :], xw[:, None, :, :], SIGNED, EMULATE), axis=3)


@triton.jit
def _kquant_q45(w32, xq32, dx, sx, s16, x_rows, m_ok, row_w, row_ok, u0, n_units, QTYPE: tl.constexpr,
                SB: tl.constexpr, EMULATE: tl.constexpr):
    """Q4_K / Q5_K blocks u0 .. u0+SB: Σ over them of W·x, [BM, BN]. Axis Q walks (block, 64-value chunk c);
    chunk c's 8 quant words hold sub-block 2c in their low nibbles and 2c + 1 in their high nibbles."""
    BW: tl.constexpr = 36 if QTYPE == 2 else 44  # block size in words
    QS: tl.constexpr = 4 if QTYPE == 2 else 12  # first quant word
    q = tl.arange(0, SB * 4)
    wi = tl.arange(0, 8)
    u = u0 + q // 4
    c = q % 4
    u_ok = u < n_units
    mask2 = row_ok[:, None] & u_ok[None, :]
    mask3 = mask2[:, :, None]
    blk = row_w[:, None] + (u * BW)[None, :]  # [BN, Q] word offsets
    words = tl.load(w32 + blk[:, :, None] + (QS + 8 * c)[None, :, None] + wi[None, None, :], mask=mask3, other=0)
    lo = words & NIBBLES
    hi = (words >> 4) & NIBBLES
    if QTYPE == 3:  # fifth bits: bit 2c (low) and 2c + 1 (high) of the matching qh byte
        qh = tl.load(w32 + blk[:, :, None] + 4 + wi[None, None, :], mask=mask3, other=0)
        lo |= ((qh >> (2 * c)[None, :, None]) & 0x01010101) << 4
        hi |= ((qh >> (2 * c + 1)[None, :, None]) & 0x01010101) << 4
    xmask = m_ok[:, None, None] & u_ok[None, :, None]
    xw = x_rows[:, None, None] * 8 + (u * 64 + 16 * c)[None, :, None] + wi[None, None, :]  # [BM, Q, 8]
    dot0 = _idot(lo, tl.load(xq32 + xw, mask=xmask, other=0), False, EMULATE).to(tl.float32)
    dot1 = _idot(hi, tl.load(xq32 + xw + 8, mask=xmask, other=0), False, EMULATE).to(tl.float32)
    gmask = m_ok[:, None] & u_ok[None, :]
    grp = x_rows[:, None] + (8 * u + 2 * c)[None, :]  # [BM, Q]: 32-value group of sub-block 2c
    # Σ q·x = dx·Σ (q - OFF)·xq + OFF·Σ x: centring the values halves the part that the int8 rounding of
    # x touches (q·err summed becomes (q - OFF)·err), and Σ x is exact.
    OFF: tl.constexpr = 8 if QTYPE == 2 else 16
    s0 = tl.load(s16 + 2 * grp, mask=gmask, other=0) + tl.load(s16 + 2 * grp + 1, mask=gmask, other=0)
    s1 = tl.load(s16 + 2 * grp + 2, mask=gmask, other=0) + tl.load(s16 + 2 * grp + 3, mask=gmask, other=0)
    sx0 = tl.load(sx + grp, mask=gmask, other=0)[:, None, :]
    sx1 = tl.load(sx + grp + 1, mask=gmask, other=0)[:, None, :]
    dot0 = tl.load(dx + grp, mask=gmask, other=0)[:, None, :] * (dot0 - OFF * s0[:, None, :].to(tl.float32)) + OFF * sx0
    dot1 = tl.load(dx + grp + 1, mask=gmask, other=0)[:, None, :] * (dot1 - OFF * s1[:, None, :].to(tl.float32)) + OFF * sx1
    head = tl.load(w32 + blk, mask=mask2, other=0)
    d = f16_bits(head)[None, :, :]
    dmin = f16_bits(head >> 16)[None, :, :]
    wa = tl.load(w32 + blk + 1, mask=mask2, other=0)  # scale bytes 0-3
    wb = tl.load(w32 + blk + 2, mask=mask2, other=0)  # 4-7
    wh = tl.load(w32 + blk + 3, mask=mask2, other=0)  # 8-11
    low = (c < 2)[None, :]
    acc = tl.zeros(dot0.shape, dtype=tl.float32)
    for nib in tl.static_range(2):  # sub-block s = 2c + nib; ggml's get_scale_min_k4 with i = s % 4
        shift = (8 * ((2 * c + nib) % 4))[None, :]
        a = (wa >> shift) & 255
        b = (wb >> shift) & 255
        h = (wh >> shift) & 255
        sc = tl.where(low, a & 63, (h & 15) | ((a >> 6) << 4)).to(tl.float32)[None, :, :]
        mn = tl.where(low, b & 63, (h >> 4) | ((b >> 6) << 4)).to(tl.float32)[None, :, :]
        if nib == 0:
            acc += d * sc * dot0 - dmin * mn * sx0
        else:
            acc += d * sc * dot1 - dmin * mn * sx1
    return tl.sum(acc, axis=2)


@triton.jit
def _q6k(w16, xq32, dx, s16, x_rows, m_ok, row_h, row_ok, u0, n_units, SB: tl.constexpr, BM: tl.constexpr,
         BN: tl.constexpr, EMULATE: tl.constexpr):
    """Q6_K blocks u0 .. u0+SB: Σ W·x, [BM, BN]. Block: 128 bytes of low nibbles, 64 bytes of 2-bit tops,
    16 int8 scales (one per 16 values), f16 d. Value 128h + 32j + l has its low nibble in byte
    64h + 32(j % 2) + l, shifted by 4(j // 2), and its top bits in byte 128 + 32h + l, shifted by 2j. Axis Q
    walks (block, r = 2h + j % 2); the static loop walks j // 2. Values are stored + 32."""
    q = tl.arange(0, SB * 4)
    wi = tl.arange(0, 8)
    u = u0 + q // 4
    r = q % 4
    h = r // 2
    jlo = r % 2
    u_ok = u < n_units
    mask2 = row_ok[:, None] & u_ok[None, :]
    mask3 = mask2[:, :, None]
    blk = row_h[:, None] + (u * 105)[None, :]  # [BN, Q] offsets in 16-bit halves
    ql = _word_from_halves(w16, blk[:, :, None] + (16 * r)[None, :, None] + 2 * wi[None, None, :], mask3)
    qh = _word_from_halves(w16, blk[:, :, None] + (64 + 16 * h)[None, :, None] + 2 * wi[None, None, :], mask3)
    xmask = m_ok[:, None, None] & u_ok[None, :, None]
    gmask = m_ok[:, None] & u_ok[None, :]
    smask = mask2[None, :, :] & m_ok[:, None, None]
    acc = tl.zeros((BM, BN, SB * 4), dtype=tl.float32)
    for jhi in tl.static_range(2):
        j = 2 * jhi + jlo  # [Q]
        vals = ((ql >> (4 * jhi)) & NIBBLES) | (((qh >> (2 * j)[None, :, None]) & 0x03030303) << 4)
        xw = x_rows[:, None, None] * 8 + (64 * u + 32 * h + 8 * j)[None, :, None] + wi[None, None, :]
        prod = _dp4a(vals[None, :, :, :], tl.load(xq32 + xw, mask=xmask, other=0)[:, None, :, :], False, EMULATE)
        halfsums = tl.sum(tl.reshape(prod, (BM, BN, SB * 4, 2, 4)), axis=4)  # 16-value groups g = l // 16
        grp16 = 2 * x_rows[:, None] + (16 * u + 8 * h + 2 * j)[None, :]  # [BM, Q]
        sc_pair = tl.load(w16 + blk + (96 + 4 * h + j)[None, :], mask=mask2, other=0).to(tl.int32)  # int8 scales of g = 0, 1
        part = tl.zeros((BM, BN, SB * 4), dtype=tl.float32)
        for g in tl.static_range(2):
            xs = tl.load(s16 + grp16 + g, mask=gmask, other=0)[:, None, :]
            sc = ((sc_pair << (24 - 8 * g)) >> 24).to(tl.float32)[None, :, :]
            dot = _pick(halfsums, g)
            part += sc * (dot - 32 * xs).to(tl.float32)
        grp = x_rows[:, None] + (8 * u + 4 * h + j)[None, :]
        acc += part * tl.load(dx + grp, mask=gmask, other=0)[:, None, :]
    d = tl.load(w16 + blk + 104, mask=mask2, other=0).to(tl.float16, bitcast=True).to(tl.float32)[None, :, :]
    return tl.sum(tl.where(smask, acc * d, 0.0), axis=2)


@triton.jit
def _pick(t, g: tl.constexpr):
    """t[..., g] of a tensor whose last axis has 2 entries."""
    a, b = tl.split(t)
    if g == 0:
        return a
    return b


@triton.jit
def _q8_q4(w16, xq32, dx, s16, x_rows, m_ok, row_h, row_ok, u0, n_units, QTYPE: tl.constexpr, SB: tl.constexpr,
           EMULATE: tl.constexpr):
    """32-value blocks u0 .. u0+SB: Q8_0 (f16 d, 32 int8) or Q4_0 (f16 d, 16 bytes: value i is nibble
    i // 16 of byte i % 16, stored + 8). Σ W·x, [BM, BN]."""
    HB: tl.constexpr = 17 if QTYPE == 0 else 9  # block size in 16-bit halves
    NW: tl.constexpr = 8 if QTYPE == 0 else 4  # quant words per block
    s = tl.arange(0, SB)
    wi = tl.arange(0, NW)
    u = u0 + s
    u_ok = u < n_units
    mask2 = row_ok[:, None] & u_ok[None, :]
    blk = row_h[:, None] + (u * HB)[None, :]  # [BN, SB]
    words = _word_from_halves(w16, blk[:, :, None] + 1 + 2 * wi[None, None, :], mask2[:, :, None])
    xmask = m_ok[:, None, None] & u_ok[None, :, None]
    xw = x_rows[:, None, None] * 8 + (8 * u)[None, :, None] + wi[None, None, :]
    gmask = m_ok[:, None] & u_ok[None, :]
    if QTYPE == 0:
        dot = _idot(words, tl.load(xq32 + xw, mask=xmask, other=0), True, EMULATE)
    else:
        lo = _idot(words & NIBBLES, tl.load(xq32 + xw, mask=xmask, other=0), False, EMULATE)
        hi = _idot((words >> 4) & NIBBLES, tl.load(xq32 + xw + 4, mask=xmask, other=0), False, EMULATE)
        g16 = 2 * x_rows[:, None] + (2 * u)[None, :]
        qsum = tl.load(s16 + g16, mask=gmask, other=0) + tl.load(s16 + g16 + 1, mask=gmask, other=0)
        dot = lo + hi - 8 * qsum[:, None, :]
    d = tl.load(w16 + blk, mask=mask2, other=0).to(tl.float16, bitcast=True).to(tl.float32)[None, :, :]
    xd = tl.load(dx + x_rows[:, None] + u[None, :], mask=gmask, other=0)[:, None, :]
    return tl.sum(d * xd * dot.to(tl.float32), axis=2)


@triton.jit
def _gemv_dp4a_kernel(xq_ptr, dx_ptr, sx_ptr, s16_ptr, w16, w32, out_ptr, expert_ptr, M, N, row_bytes, n_units,
                      expert_bytes, n_groups, out_stride, QTYPE: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, SB: tl.constexpr, HAS_EXPERTS: tl.constexpr, EMULATE: tl.constexpr):
    """out[m, n] = Σ_k x[m, k] · W[n, k] for BM activation rows and BN weight rows per program."""
    ms = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = ms < M
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < N
    row_base = rows.to(tl.int64) * row_bytes  # bytes
    if HAS_EXPERTS:
        row_base += tl.load(expert_ptr + tl.program_id(0)).to(tl.int64) * expert_bytes
    x_rows = ms.to(tl.int64) * n_groups  # first 32-value group of each activation row
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for u0 in range(0, n_units, SB):
        if QTYPE == 2 or QTYPE == 3:
            acc += _kquant_q45(w32, xq_ptr, dx_ptr, sx_ptr, s16_ptr, x_rows, m_ok,
                               row_base // 4, row_ok, u0, n_units, QTYPE, SB, EMULATE)
        elif QTYPE == 4:
            acc += _q6k(w16, xq_ptr, dx_ptr, s16_ptr, x_rows, m_ok, row_base // 2,
                        row_ok, u0, n_units, SB, BM, BN, EMULATE)
        else:
            acc += _q8_q4(w16, xq_ptr, dx_ptr, s16_ptr, x_rows, m_ok,
                          row_base // 2, row_ok, u0, n_units, QTYPE, SB, EMULATE)
    out = out_ptr + ms.to(tl.int64)[:, None] * out_stride + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [M, K] (K a multiple of 32) -> xq int32 words [M, K/4], dx, sx float32 [M, K/32], s16 int32 [M, K/16]."""
    x = x.contiguous()
    m, k = x.shape
    groups = k // 32
    xq = torch.empty(m, k, dtype=torch.int8, device=x.device)
    dx = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    sx = torch.empty_like(dx)
    s16 = torch.empty(m, 2 * groups, dtype=torch.int32, device=x.device)
    _quantize_kernel[(m, triton.cdiv(groups, 16))](x, xq, dx, sx, s16, groups, x.stride(0), GROUPS=16)
    return xq.view(torch.int32), dx, sx, s16


# (BLOCK_N, blocks per step, warps) candidates; the first is the default. 32-value types step over more blocks.
_K_CANDIDATES = [(4, 4, 4), (2, 4, 2), (4, 8, 4), (8, 4, 4), (8, 2, 4), (2, 8, 4)]
_B_CANDIDATES = [(4, 16, 4), (2, 16, 2), (4, 32, 4), (8, 16, 4), (8, 8, 4)]
_TUNED: dict[tuple, tuple] = {}
_TUNE = (os.environ.get("HF2Q_GEMV_TUNE") or "1") == "1"
if (os.environ.get("HF2Q_GEMV_TUNE") or "1") not in ("0", "1"):
    raise ValueError(f"HF2Q_GEMV_TUNE must be 0 or 1, not {os.environ['HF2Q_GEMV_TUNE']!r}")


def candidates(qtype: str) -> list[tuple[int, int, int]]:
    return list(_B_CANDIDATES if qtype in ("Q8_0", "Q4_0") else _K_CANDIDATES)


def _block_m(m: int, experts) -> int:
    return 1 if experts is not None else min(16, 1 << (m - 1).bit_length())


def _time(fn, reps: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def best_config(xs, raw, qtype: str, n: int, experts) -> tuple[int, int, int]:
    """The fastest candidate for this shape, timed once per (type, N, K, rows rounded up to a power of two,
    experts) on CUDA outside graph capture (a capture's warm-up step does it); the first candidate
    elsewhere, inside a capture, or with HF2Q_GEMV_TUNE=0."""
    xq = xs[0]
    if not xq.is_cuda or not _TUNE:
        return candidates(qtype)[0]
    m = xq.shape[0]
    key = (qtype, n, xq.shape[1] * 4, 1 << (m - 1).bit_length(), experts is not None)
    cfg = _TUNED.get(key)
    if cfg is None:
        if torch.cuda.is_current_stream_capturing():
            return candidates(qtype)[0]
        timed = [(_time(lambda c=c: _launch(xs, raw, qtype, n, experts, c)), c) for c in candidates(qtype)]
        cfg = _TUNED[key] = min(timed)[1]
    return cfg


def _launch(xs, raw, qtype, n, experts, config, out_dtype=torch.float32) -> torch.Tensor:
    xq, dx, sx, s16 = xs
    m, k = xq.shape[0], xq.shape[1] * 4
    n_units = k // BLOCK_ELEMS[qtype]
    rb = n_units * BLOCK_BYTES[qtype]
    block_n, sb, warps = config
    bm = _block_m(m, experts)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    flat = raw.view(-1)
    w16 = flat.view(torch.int16)
    w32 = flat.view(torch.int32) if qtype in ("Q4_K", "Q5_K") else w16  # only those blocks are 4-byte multiples
    _gemv_dp4a_kernel[(triton.cdiv(m, bm), triton.cdiv(n, block_n))](
        xq, dx, sx, s16, w16, w32, out, experts if experts is not None else flat, m, n, rb, n_units, n * rb, k // 32,
        out.stride(0), QTYPE=QTYPE_ID[qtype], BM=bm, BN=block_n, SB=sb, HAS_EXPERTS=experts is not None,
        EMULATE=EMULATE, num_warps=warps)
    return out


def gemv(x: torch.Tensor, raw: torch.Tensor, qtype: str, n: int, experts: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] times quantized rows raw [(E,) N, row_bytes] -> [M, N] in x's dtype.

    With `experts` [M] (int32), row m of x is multiplied by expert experts[m] of a stacked [E, N, ...] weight.
    """
    xs = quantize_rows(x)
    return _launch(xs, raw, qtype, n, experts, config or best_config(xs, raw, qtype, n, experts), x.dtype)
