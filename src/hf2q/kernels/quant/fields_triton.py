"""Readers of GGUF block fields inside Triton kernels, shared by the dequantize and mat-vec kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def u8(w8, off, mask):
    """Bytes at w8 + off as int32 (0 where masked)."""
    return tl.load(w8 + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def kquant_scale_min(w8, blk, s, mask):
    """6-bit scale and min of sub-block s of each K-quant block (ggml's get_scale_min_k4).
    blk: [BN, Q] byte offsets of the blocks; s: [Q] sub-block index 0..7."""
    i = (s % 4)[None, :]
    a = u8(w8, blk + 4 + i, mask)
    b = u8(w8, blk + 8 + i, mask)
    h = u8(w8, blk + 12 + i, mask)
    low = (s < 4)[None, :]
    sc = tl.where(low, a & 63, (h & 15) | ((a >> 6) << 4))
    mn = tl.where(low, b & 63, (h >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def f16_bits(bits):
    """float32 value of the f16 whose bits are the low 16 of int32 `bits`."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


# Int-to-float conversions issue at 16 a clock and SM on Hopper, float adds at 128: the kernels that turn a value
# a weight into a float (the tile kernel's fields, mmq's group dots) build the float from its bits instead.
@triton.jit
def small_float(f):
    """float32 of integers 0 <= f < 2^23: f's bits under the exponent of 2^23 make 2^23 + f exactly (an OR, which
    fuses with the mask that cut f out), and subtracting 2^23 is exact."""
    return (f | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def int_float(i):
    """float32 of integers |i| < 2^22 (signed): 2^23 + 2^22 + i in the bits of 2^23 + 2^22, exact, minus that."""
    return (i + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
