"""GGUF block formats kept quantized: their sizes, and random valid blocks for benchmarks and tests.

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
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw.detach().cpu().numpy().reshape(-1), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))


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
