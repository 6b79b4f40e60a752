"""GGUF block formats kept quantized: their sizes, the interleaved rows K-quants are kept in on CUDA, and random
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
    if is_interleaved(raw, qtype):
        raise ValueError("interleaved rows are for the GPU kernels; from_gpu_rows gives gguf's layout back")
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw.detach().cpu().numpy().reshape(-1), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))


# ---- K-quants kept on the GPU: interleaved rows ----------------------------------------------------
# A decode thread of the mat-vec owns whole blocks, and neighbouring threads own neighbouring blocks of
# a row. In ggml's order those blocks are 144 (Q4_K), 176 (Q5_K) or 210 (Q6_K) bytes apart, so one
# 16-byte load of a warp touches 32 cache lines, and the kernels stall on L1 throughput long before
# DRAM's. Kept on CUDA, each row of B K-quant blocks is regrouped in 16-byte quads instead: quad q of
# block u moves to quad q·B + u of the row, so the warp's load reads consecutive bytes. A Q4_K block is
# 9 quads (header, 8 of nibbles), a Q5_K block 11 (header, 2 of fifth bits, 8 of nibbles). A Q6_K
# block (ql[128] low nibbles, qh[64] top bits, scales[16] int8, f16 d) has 13 quads before its d; the
# d of every block follow the 13·B quads as one plane, and the row is padded with zeros to a multiple
# of 16 bytes (only where B is not a multiple of 8: at most 14 bytes a row). Kept rows are int32 words,
# so the dtype tells the layouts apart everywhere: uint8 is ggml's byte order (the CPU reference reads
# it), int32 the interleaved rows (the Triton kernels read them).
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
QUADS = {"Q4_K": 9, "Q5_K": 11, "Q6_K": 13}  # 16-byte quads a block interleaves (Q6_K: all but d)


def gpu_row_words(qtype: str, in_features: int) -> int:
    """int32 words of one interleaved row of `in_features` values (Q6_K padded to 16 bytes)."""
    return -(-row_bytes(qtype, in_features) // 16) * 4


def kept_row(qtype: str, in_features: int, interleaved: bool) -> tuple[torch.dtype, int]:
    """(dtype, elements) of one kept row of `qtype`: interleaved int32 words, else ggml's uint8 bytes."""
    if interleaved:
        return torch.int32, gpu_row_words(qtype, in_features)
    return torch.uint8, row_bytes(qtype, in_features)


def is_interleaved(raw: torch.Tensor, qtype: str) -> bool:
    return qtype in KQUANTS and raw.dtype == torch.int32


def to_gpu_rows(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """ggml-order K-quant rows, uint8 [..., rows, row_bytes], as interleaved int32 rows [..., rows,
    gpu_row_words] (layout above): every warp load of the GPU kernels then reads consecutive bytes."""
    elems, size = block_layout(qtype)
    nb = raw.shape[-1] // size
    if qtype not in KQUANTS or raw.dtype != torch.uint8 or raw.shape[-1] != size * nb or nb == 0:
        raise ValueError(f"not ggml-order {qtype} rows: {raw.dtype} {tuple(raw.shape)}")
    quads = QUADS[qtype]
    blocks = raw.reshape(*raw.shape[:-1], nb, size)
    parts = [blocks[..., :16 * quads].unflatten(-1, (quads, 16)).transpose(-3, -2).flatten(-3)]
    if qtype == "Q6_K":
        parts.append(blocks[..., 16 * quads:].flatten(-2))
        parts.append(raw.new_zeros(*raw.shape[:-1], 4 * gpu_row_words(qtype, elems * nb) - size * nb))
    rows = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0].contiguous()  # one copy of a large weight
    return rows.view(torch.int32)


def from_gpu_rows(rows: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The ggml-order uint8 rows that to_gpu_rows regrouped, byte for byte."""
    _, size = block_layout(qtype)
    nb = row_bytes(qtype, in_features) // size
    if not is_interleaved(rows, qtype) or rows.shape[-1] != gpu_row_words(qtype, in_features):
        raise ValueError(f"not interleaved {qtype} rows of {in_features} values: {rows.dtype} {tuple(rows.shape)}")
    flat = rows.contiguous().view(torch.uint8)
    quads = QUADS[qtype]
    parts = [flat[..., :16 * quads * nb].unflatten(-1, (quads, nb, 16)).transpose(-3, -2).flatten(-2)]
    if qtype == "Q6_K":
        parts.append(flat[..., 16 * quads * nb:size * nb].unflatten(-1, (nb, 2)))
    return torch.cat(parts, dim=-1).flatten(-2)


def interleaved_on(qtype: str, device) -> bool:
    """Whether `qtype` blocks kept on `device` are interleaved rows: K-quants on CUDA."""
    return qtype in KQUANTS and torch.device(device).type == "cuda"


def keep_blocks(raw: torch.Tensor, qtype: str, device) -> torch.Tensor:
    """ggml-order blocks [..., rows, row_bytes] as a kept weight on `device`: K-quants on CUDA in
    interleaved rows (see above), everything else as the bytes it came as. The one place blocks are laid
    out for the GPU."""
    raw = raw.to(device)
    return to_gpu_rows(raw, qtype) if interleaved_on(qtype, raw.device) else raw


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


# ---- Affine groups of 32: the form Triton low-bit libraries take -------------------------------------
AFFINE_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_K": 4, "Q5_K": 8}  # type -> bits a code is stored in


def affine_groups(raw: torch.Tensor, qtype: str, shape: tuple[int, int]):
    """ggml-order rows as codes [n, k] (uint8), scale and offset [n, k / 32] (fp32) with value = scale · code +
    offset in every 32-value group: a Q8_0/Q4_0 block, a Q4_K/Q5_K sub-block. (Q6_K's 16-value groups have no
    such form.) The weight-only int4/int8 kernels of low-bit libraries read this, their zero being -offset / scale.
    CPU tensors; interleaved rows (from_gpu_rows gives ggml's order back) and wrong sizes are refused."""
    if qtype not in AFFINE_TYPES:
        raise ValueError(f"{qtype} has no affine form in groups of 32 (types with one: {', '.join(AFFINE_TYPES)})")
    n, k = shape
    if raw.dtype != torch.uint8 or raw.numel() != n * row_bytes(qtype, k):
        raise ValueError(f"{qtype} rows of shape {tuple(shape)} are {n * row_bytes(qtype, k)} bytes in ggml's order, "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    nbytes = block_layout(qtype)[1]
    b = raw.detach().cpu().numpy().reshape(-1, nbytes)
    f16 = lambda lo: b[:, lo:lo + 2].copy().view(np.float16).astype(np.float32)  # noqa: E731  [blocks, 1]
    if qtype == "Q8_0":
        codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        scale, offset = f16(0), -128 * f16(0)
    elif qtype == "Q4_0":
        codes = np.concatenate([b[:, 2:18] & 15, b[:, 2:18] >> 4], axis=1)
        scale, offset = f16(0), -8 * f16(0)
    else:  # sub-block j: nibbles of bytes 32(j // 2).., low (j even) or high; Q5_K's fifth bit j of qh
        from gguf.quants import Q4_K  # Q5_K's 12-byte scale field is Q4_K's

        sc, mn = (v.astype(np.float32) for v in Q4_K.get_scale_min(b[:, 4:16]))
        qs = b[:, -128:].reshape(-1, 4, 1, 32)
        codes = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(-1, 8, 32)
        if qtype == "Q5_K":
            fifth = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            codes = codes | (fifth << 4)
        scale, offset = f16(0) * sc, -(f16(2) * mn)
    codes = np.ascontiguousarray(codes).reshape(n, k)
    return (torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scale, np.float32)).reshape(n, k // 32),
            torch.from_numpy(np.ascontiguousarray(offset, np.float32)).reshape(n, k // 32))
