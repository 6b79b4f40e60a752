"""GGUF block formats kept quantized: their sizes, the planar rows Q6_K is kept in on CUDA, and random
valid blocks for benchmarks and tests.

Random blocks are built field by field (scales, mins, packed quants) so that dequantized values have
a chosen spread, as real weights do; `gguf.quants.dequantize` is the judge of what they mean.
"""
from __future__ import annotations

import numpy as np
import torch

# Types multiplied directly from their blocks (everything else in a GGUF is dequantized at load).
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")


def block_layout(qtype: str) -> tuple[int, int]:
    """(elements per block, bytes per block), from the gguf package's own table."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]


def row_bytes(qtype: str, in_features: int) -> int:
    elems, nbytes = block_layout(qtype)
    if in_features % elems:
        raise ValueError(f"{qtype} rows hold multiples of {elems} values, not {in_features}")
    return in_features // elems * nbytes


def dequantize_ref(raw: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 values of quantized rows, by gguf's reference dequantization (the test oracle)."""
    if is_planar(raw, qtype):
        raise ValueError("planar Q6_K rows are for the GPU kernels; q6_k_from_planar gives gguf's layout back")
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw.detach().cpu().numpy().reshape(-1), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))


# ---- Q6_K kept on the GPU: planar rows -------------------------------------------------------------
# A Q6_K block is 210 bytes (ql[128] low nibbles, qh[64] top bits, scales[16] int8, f16 d), so blocks in
# ggml's order are only 2-byte aligned and a GPU kernel would have to join 16-bit halves into words.
# Kept on CUDA, each row's blocks are regrouped into planes instead: [ql of every block | qh of every
# block | scales of every block | d of every block]. Within a row of B blocks the planes start at bytes
# 0, 128·B, 192·B and 208·B, all multiples of 16 for any B; the row stride (210·B bytes) is padded with
# zeros to a multiple of 16 bytes, which adds bytes only where B is not a multiple of 8 (at most 14 a
# row). Planar rows are held as int32 words, so the dtype tells the two layouts apart everywhere: uint8
# is ggml's byte order (the CPU reference reads it), int32 the planar rows (the Triton kernels read it).
Q6_K_PLANES = (128, 64, 16, 2)  # bytes per block of ql, qh, scales, d


def planar_row_words(in_features: int) -> int:
    """int32 words of one planar Q6_K row of `in_features` values (210 bytes a block, padded to 16)."""
    nbytes = row_bytes("Q6_K", in_features)
    return -(-nbytes // 16) * 4


def kept_row(qtype: str, in_features: int, planar: bool) -> tuple[torch.dtype, int]:
    """(dtype, elements) of one kept row of `qtype`: planar Q6_K int32 words, else ggml's uint8 bytes."""
    if planar:
        return torch.int32, planar_row_words(in_features)
    return torch.uint8, row_bytes(qtype, in_features)


def is_planar(raw: torch.Tensor, qtype: str) -> bool:
    return qtype == "Q6_K" and raw.dtype == torch.int32


def q6_k_to_planar(raw: torch.Tensor) -> torch.Tensor:
    """ggml-order Q6_K rows, uint8 [..., rows, 210·B], as planar int32 rows [..., rows, planar_row_words]
    (layout above): the GPU then reads every field with aligned 32-bit (and 16-byte) loads."""
    nb = raw.shape[-1] // 210
    if raw.dtype != torch.uint8 or raw.shape[-1] != 210 * nb or nb == 0:
        raise ValueError(f"not ggml-order Q6_K rows: {raw.dtype} {tuple(raw.shape)}")
    blocks = raw.reshape(*raw.shape[:-1], nb, 210)
    planes, start = [], 0
    for size in Q6_K_PLANES:
        planes.append(blocks[..., start:start + size].flatten(-2))
        start += size
    words = planar_row_words(256 * nb)
    planes.append(raw.new_zeros(*raw.shape[:-1], 4 * words - 210 * nb))
    return torch.cat(planes, dim=-1).view(torch.int32)


def q6_k_from_planar(planar: torch.Tensor, in_features: int) -> torch.Tensor:
    """The ggml-order uint8 rows that q6_k_to_planar regrouped, byte for byte."""
    nb = row_bytes("Q6_K", in_features) // 210
    if planar.dtype != torch.int32 or planar.shape[-1] != planar_row_words(in_features):
        raise ValueError(f"not planar Q6_K rows of {in_features} values: {planar.dtype} {tuple(planar.shape)}")
    flat = planar.contiguous().view(torch.uint8)
    planes, start = [], 0
    for size in Q6_K_PLANES:
        planes.append(flat[..., start:start + size * nb].unflatten(-1, (nb, size)))
        start += size * nb
    return torch.cat(planes, dim=-1).flatten(-2)


def planar_on(qtype: str, device) -> bool:
    """Whether `qtype` blocks kept on `device` are planar rows: Q6_K on CUDA."""
    return qtype == "Q6_K" and torch.device(device).type == "cuda"


def keep_blocks(raw: torch.Tensor, qtype: str, device) -> torch.Tensor:
    """ggml-order blocks [..., rows, row_bytes] as a kept weight on `device`: Q6_K on CUDA in planar rows
    (see above), everything else as the bytes it came as. The one place blocks are laid out for the GPU."""
    raw = raw.to(device)
    return q6_k_to_planar(raw) if planar_on(qtype, raw.device) else raw


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K 12-byte scale field from 6-bit scales and mins [blocks, 8]."""
    b = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    b[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    b[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    b[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return b


def random_blocks(qtype: str, rows: int, in_features: int, std: float = 0.02, seed: int = 0) -> torch.Tensor:
    """Valid random rows of `qtype` blocks, uint8 [rows, row_bytes]; values spread about ±3·std."""
    elems, nbytes = block_layout(qtype)
    n = rows * row_bytes(qtype, in_features) // nbytes
    rng = np.random.default_rng(seed)
    amax = (3 * std * rng.uniform(0.5, 1.5, n)).astype(np.float32)  # per block
    u8 = lambda k: rng.integers(0, 256, (n, k), dtype=np.uint8)  # noqa: E731
    if qtype == "Q8_0":
        q = np.clip(np.rint(rng.normal(0, 127 / 3, (n, 32))), -127, 127).astype(np.int8).view(np.uint8)
        parts = [_f16_bytes(amax / 127), q]
    elif qtype == "Q4_0":
        parts = [_f16_bytes(amax / 8), u8(16)]
    elif qtype in ("Q4_K", "Q5_K"):
        top = 15 if qtype == "Q4_K" else 31
        sc = rng.integers(40, 64, (n, 8), dtype=np.uint8)
        mn = rng.integers(40, 64, (n, 8), dtype=np.uint8)
        d = 2 * amax / (top * 63)
        parts = [_f16_bytes(d), _f16_bytes(d * top / 2), _pack_k_scales(sc, mn)]  # dmin centres the values
        parts += [u8(32), u8(128)] if qtype == "Q5_K" else [u8(128)]
    elif qtype == "Q6_K":
        sc = (rng.integers(16, 128, (n, 16)) * rng.choice([-1, 1], (n, 16))).astype(np.int8).view(np.uint8)
        parts = [u8(128), u8(64), sc, _f16_bytes(amax / (32 * 127))]
    else:
        raise ValueError(f"not a block-quantized type: {qtype}")
    blocks = np.concatenate(parts, axis=1)
    assert blocks.shape == (n, nbytes)
    return torch.from_numpy(blocks.reshape(rows, -1).copy())
