"""Triton side of the compressed K/V pools (fp8, tq8/tq6/tq5): the store kernel that encodes new rows into the pool,
and the in-register decoding of stored rows that the paged decode attention (paged_triton) uses.

A vector is stored as head_dim payload bytes (a row of its own, 16-byte aligned: the codes load 16 at a time) and
its side value at the same vector index in a separate plane: fp8's scale exponent (one byte), TurboQuant's fp32
norm (cache.kv_pool). Writing and reading compute what the codecs (hf2q.kv_codec) compute:

- FP8: the scale is the power of two 2^ceil(log2(amax/448)), found from amax's bits and stored as its biased
  exponent (E8M0); values x/scale (exact: a power of two) rounded to e4m3 (nearest, ties to even). The e4m3 bits
  are made with integer arithmetic, which rounds as torch does on every device (Triton's own fp32 → fp8 casts
  differ between the GPU and its interpreter); reading them is the hardware's exact e4m3 → fp16 conversion, two
  values an instruction, and the exponent byte becomes the scale by a shift.
- TurboQuant: the store applies the signs and the normalised Walsh–Hadamard transform by butterflies in the same
  order as `kv_codec.fwht`, takes the L2 norm and finds each channel's codebook cell by binary search over the
  boundaries. Reading, the codes become centroids (a gather from the codebook in shared memory) and the norm a
  factor per row; attention runs in the rotated domain (paged_triton). The codebook width only changes the
  tables, so tq8, tq6 and tq5 share the kernels.

Everything is capturable in a CUDA graph: fixed shapes, no host synchronisation; the device tables are made on
first use (the graphs' warm-up steps), before any capture.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
import triton
import triton.language as tl

from hf2q.kv_codec import TurboQuantCodec, codebook
from hf2q.kernels.tuning import pdl

_TABLE = 256  # codebook and boundary tables padded to the 8-bit size: one binary search serves every width


@lru_cache(maxsize=None)
def device_tables(fmt: str, head_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(signs [D], boundaries [256] padded with +inf) in fp32 on `device` for a TurboQuant format: the store's
    encoding and the rotation of q and of the attention output. Made once per (format, shape, device)."""
    codec = TurboQuantCodec(head_dim, int(fmt[2:]))
    return codec.signs.to(device), _padded(codebook(codec.bits)[1], math.inf).to(device)


@lru_cache(maxsize=None)
def centroid_table(fmt: str, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A TurboQuant format's centroids padded to 256, in the dtype of the decode kernel's tensor-core operands."""
    return _padded(codebook(int(fmt[2:]))[0], 0.0).to(dtype).to(device)


def _padded(table: torch.Tensor, fill: float) -> torch.Tensor:
    out = torch.full((_TABLE,), fill)
    out[: table.numel()] = table
    return out


# ---- e4m3 bits by integer arithmetic ----------------------------------------------------------------------------
@triton.jit
def _e4m3_bits(x):
    """fp32 x with |x| ≤ 448 → e4m3fn bits (int32 in [0, 255]), rounded to nearest, ties to even."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    # normal: drop 20 mantissa bits with round-half-even, then rebias the exponent from 127 to 7
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal (|x| < 2^-6): the integer count of 2^-9 steps, rounded by adding 2^23 in fp32
    sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    mag = tl.minimum(tl.where(a < 0.015625, sub, normal), 126)
    return tl.where(x.to(tl.int32, bitcast=True) < 0, mag + 128, mag)  # the sign bit: -0.0 too


@triton.jit
def _fp8_scale_exponent(amax):
    """kv_codec.fp8_scale_exponent: the biased exponent (int32) of the smallest power of two s with amax ≤ 448·s
    (448 = 1.75·2^8), at least 1; 127 for amax 0."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.where(amax > 0, tl.maximum(exponent, 1), 127)


# ---- store ---------------------------------------------------------------------------------------------------------
@triton.jit
def fwht(x, inv_sqrt_d, ROWS: tl.constexpr, HD: tl.constexpr, LOG2: tl.constexpr):
    """Normalised Walsh–Hadamard transform of each row of x [ROWS, HD] with kv_codec.fwht's additions, in its
    order. Each stage pairs the elements that differ in the lowest index bit (a = bit 0, b = bit 1) and writes
    a + b, a - b to the halves, which moves that bit to the top: the next stage's lowest bit is the next stride's,
    and after LOG2 stages every element is back in place."""
    for _ in tl.static_range(LOG2):
        a, b = tl.split(tl.reshape(x, [ROWS, HD // 2, 2]))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 2, 1]), [ROWS, HD])
    return x * inv_sqrt_d


@triton.jit
def _encode_row(x_ptr, dst_ptr, side_ptr, sign_ptr, bound_ptr, sqrt_d, inv_sqrt_d, HD: tl.constexpr,
                LOG2: tl.constexpr, TQ: tl.constexpr):
    """One vector's codes and side value, with the codec's roundings: divisions and square roots rounded to nearest
    (Triton's `/` and sqrt are approximate on the GPU), the codec's constants rounded from double as torch rounds
    them."""
    d = tl.arange(0, HD)
    x = tl.load(x_ptr + d).to(tl.float32)
    if TQ:
        y = tl.reshape(fwht(tl.reshape(x * tl.load(sign_ptr + d), [1, HD]), inv_sqrt_d, 1, HD, LOG2), [HD])
        norm = tl.sqrt_rn(tl.sum(y * y, 0))
        # torch computes sqrt(D) / norm as (1 / norm) * sqrt(D); a zero vector stores norm 0 (kv_codec)
        z = y * tl.where(norm > 1e-10, tl.div_rn(1.0, norm) * sqrt_d, 0.0)
        pos = tl.zeros([HD], tl.int32)  # boundaries below z: the codebook index
        step = 128
        for _ in tl.static_range(8):
            below = tl.load(bound_ptr + pos + (step - 1)) < z
            pos = tl.where(below, pos + step, pos)
            step = step // 2
        tl.store(dst_ptr + d, pos.to(tl.uint8))
        tl.store(side_ptr, norm)
    else:
        exponent = _fp8_scale_exponent(tl.max(tl.abs(x), 0))
        inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # 1/scale, exactly
        tl.store(dst_ptr + d, _e4m3_bits(x * inverse).to(tl.uint8))
        tl.store(side_ptr, exponent.to(tl.uint8))


@triton.jit
def _store_kernel(k_ptr, v_ptr, map_ptr, kstore_ptr, vstore_ptr, kside_ptr, vside_ptr, sign_ptr, bound_ptr, NKV,
                  stride_kt, stride_kh, stride_vt, stride_vh, sqrt_d, inv_sqrt_d, HD: tl.constexpr,
                  LOG2: tl.constexpr, TQ: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = tl.load(map_ptr + t).to(tl.int64)
    if h < NKV:
        vec = row * NKV + h  # the vector's index: its payload row and its side value
        _encode_row(k_ptr + t * stride_kt + h * stride_kh, kstore_ptr + vec * HD, kside_ptr + vec, sign_ptr,
                    bound_ptr, sqrt_d, inv_sqrt_d, HD, LOG2, TQ)
    else:
        vh = h - NKV
        vec = row * NKV + vh
        _encode_row(v_ptr + t * stride_vt + vh * stride_vh, vstore_ptr + vec * HD, vside_ptr + vec, sign_ptr,
                    bound_ptr, sqrt_d, inv_sqrt_d, HD, LOG2, TQ)


def store(fmt: str, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
          k_side: torch.Tensor, v_side: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Encode K/V [T, nkv, hd] (last dim contiguous) into a layer's u8 payload rows [rows, nkv, hd] and side values
    [rows, nkv] (fp8: u8 exponents; TurboQuant: fp32 norms) at slot_mapping [T], as CompressedKVPool.store does."""
    t, nkv, hd = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1
    for rows, side in ((k_rows, k_side), (v_rows, v_side)):
        assert rows.is_contiguous() and side.is_contiguous() and rows.dtype == torch.uint8
        assert rows.shape[1:] == (nkv, hd) and side.shape == rows.shape[:2]
    tq = fmt != "fp8"
    assert k_side.dtype == (torch.float32 if tq else torch.uint8)
    if tq:
        signs, bounds = device_tables(fmt, hd, str(k.device))
    else:
        signs = bounds = k_rows  # unread
    _store_kernel[(t, 2 * nkv)](k, v, slot_mapping, k_rows, v_rows, k_side, v_side, signs, bounds, nkv, k.stride(0),
                                k.stride(1), v.stride(0), v.stride(1), math.sqrt(hd), 1.0 / math.sqrt(hd), HD=hd,
                                LOG2=hd.bit_length() - 1, TQ=tq, num_warps=1 if hd <= 128 else 2,
                                **pdl.launch_options(k.device))


# ---- reading ---------------------------------------------------------------------------------------------------------
@triton.jit
def unit_rows(x, DOT: tl.constexpr):
    """x [M, N] fp32 as (u [M, N] in DOT, f [M]) with x = u · f[:, None]: f is the power of two at or below each
    row's largest magnitude (1 for a zero row), so u's largest is in [1, 2) and dividing by f rounds nothing. This
    keeps fp16 operands in range whatever the rows' scale."""
    amax = tl.max(tl.abs(x), 1)
    exponent = amax.to(tl.int32, bitcast=True) & 0x7F800000
    exponent = tl.where(amax > 0, tl.maximum(exponent, 1 << 23), 127 << 23)  # below the normals: 2^-126
    f = exponent.to(tl.float32, bitcast=True)
    inv_f = ((254 << 23) - exponent).to(tl.float32, bitcast=True)  # 1/f, exactly
    return (x * inv_f[:, None]).to(DOT), f


@triton.jit
def decoded_tile(ptr, side_ptr, vec, valid, cb_ptr, HD: tl.constexpr, TQ: tl.constexpr, DOT: tl.constexpr):
    """A tile's unit values [N, HD] in DOT (e4m3 values, or centroids from the table at cb_ptr, held in DOT by the
    caller so the lookup converts nothing) and per-row factors [N] in fp32 (scale, or norm/√D). vec [N] are the
    vectors' indices: payload rows of HD bytes at ptr + vec·HD (HD a power of two ≥ 16: the codes load 16 at a
    time), side values at side_ptr + vec (fp8: u8 exponents, TurboQuant: fp32 norms; a layer's u8 plane a whole
    number of 4-byte words). TurboQuant's tiles, and fp8's where a head is too narrow for `e4m3_planes`."""
    d = tl.arange(0, HD)
    codes = tl.load(ptr + vec[:, None] * HD + d[None, :], mask=valid[:, None], other=0)
    if TQ:
        norm = tl.load(side_ptr + vec, mask=valid, other=0.0)
        # a gather from the table in shared memory: a 32-bit address a value, against 64-bit ones from global memory
        table = tl.load(cb_ptr + tl.arange(0, 256)).to(DOT)  # the codebook padded to 256 (centroid_table)
        flat = tl.reshape(codes.to(tl.int32), [codes.shape[0] * HD])
        unit = tl.reshape(tl.gather(table, flat, 0), [codes.shape[0], HD])
        return unit, norm * (1.0 / tl.sqrt(HD * 1.0))
    return codes.to(tl.float8e4nv, bitcast=True).to(DOT), _fp8_scales(side_ptr, vec, valid)


@triton.jit
def _fp8_scales(side_ptr, vec, valid):
    """The scales [N] of fp8 vectors vec [N] from their u8 exponents at side_ptr + vec: each exponent byte from its
    aligned 4-byte word (the neighbouring heads' bytes), one word load a row, which the pipeline copies like the
    codes, where a byte load would wait in the loop (a layer's plane is a whole number of words)."""
    word = tl.load((side_ptr + (vec - vec % 4)).to(tl.pointer_type(tl.int32)), mask=valid, other=0)
    exponent = (word >> ((vec % 4) * 8).to(tl.int32)) & 255
    return (exponent << 23).to(tl.float32, bitcast=True)  # 2^(e − 127); 0 for the masked rows


@triton.jit
def quarters(x, R: tl.constexpr, HD: tl.constexpr):
    """x [R, HD] as the four [R, HD/4] planes x0..x3, plane j holding channels 4c + j: how `e4m3_planes` lays out a
    tile, so a product over HD is the sum of the planes' products."""
    even, odd = tl.split(tl.reshape(x, [R, HD // 4, 2, 2]))  # [r, c, m, t] is channel 4c + 2m + t
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _e4m3_plane(words, j: tl.constexpr, DOT: tl.constexpr):
    return ((words >> (8 * j)) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DOT)


@triton.jit
def e4m3_planes(ptr, side_ptr, vec, valid, HD: tl.constexpr, DOT: tl.constexpr, CVT: tl.constexpr):
    """An fp8 tile's e4m3 values as four planes [N, HD/4] in DOT, plane j holding channels 4c + j, and the rows'
    scales [N] in fp32; vectors as for `decoded_tile`, HD ≥ 64 (a plane must be as wide as the tensor cores' 16).

    The codes load as 4-byte words and each word's bytes go to the four planes, so a plane's values sit in
    registers as the tensor cores take them, where a [N, HD] tile of bytes took a shared-memory load per two values
    and its address arithmetic (sm_90 machine code of the decode loop, Triton 3.6, 64 keys on 4 warps: 3,542
    instructions a key against 2,312 with the planes; bf16 rows take 1,772; on an H100, 64 sequences of 32k tokens at
    the 9B's heads: 2,074 µs against 1,640, bf16 2,735). CVT: two neighbouring words at a time, their bytes paired
    by plane with two byte permutes, each pair one of the hardware's e4m3 → f16x2 conversions (DOT fp16): the
    pairs the tensor cores take; otherwise, and under the interpreter, which runs no PTX, Triton's cast gives the
    same values."""
    w = tl.arange(0, HD // 4)
    words = tl.load((ptr + vec[:, None] * HD).to(tl.pointer_type(tl.int32)) + w[None, :], mask=valid[:, None],
                    other=0)
    scale = _fp8_scales(side_ptr, vec, valid)
    if CVT:
        u0, u1, u2, u3 = tl.inline_asm_elementwise(
            "{ .reg .b16 p0, p1, p2, p3; .reg .b32 t0, t1; prmt.b32 t0, $4, $5, 0x5140; prmt.b32 t1, $4, $5, 0x7362; "
            "mov.b32 {p0, p1}, t0; mov.b32 {p2, p3}, t1; cvt.rn.f16x2.e4m3x2 $0, p0; cvt.rn.f16x2.e4m3x2 $1, p1; "
            "cvt.rn.f16x2.e4m3x2 $2, p2; cvt.rn.f16x2.e4m3x2 $3, p3; }",
            "=r,=r,=r,=r,r,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        u0 = _e4m3_plane(words, 0, DOT)
        u1 = _e4m3_plane(words, 1, DOT)
        u2 = _e4m3_plane(words, 2, DOT)
        u3 = _e4m3_plane(words, 3, DOT)
    return u0, u1, u2, u3, scale
