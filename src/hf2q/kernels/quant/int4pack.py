"""Q4_K and Q4_0 weights at 5-64 rows through PyTorch's own int4 weight-only CUDA kernel
(`torch._weight_int4pack_mm`, "tinygemm"), opted into with HF2Q_QUANT_MM=int4pack.

Both types are 4-bit codes with an affine map per group of 32 values (value = scale * code + offset:
a Q4_K sub-block, a Q4_0 block). torch's kernel reads codes tiled its own way and, per group, a bf16
(scale, zero) pair with value = (code - 8) * scale + zero. The copy in that form is built once per weight
on the weight's device from the kept blocks (about 0.625 bytes a value beside the blocks' 0.5625) and kept
beside them; the blocks still serve 1-4 rows (the int8 mat-vec) and prefill.

Not exact: scale and zero are rounded to bf16 (8 significant bits; a Q4_K scale is an f16 times a 6-bit
field, up to 17), where the dequantized copy rounds each value once. The error against the dequantized
product is stated and bounded in tests/kernels/test_int4pack.py. A row's result does not depend on the other
rows of its batch (no split of K that follows the row count), which the same test checks.
"""
from __future__ import annotations

import torch

from hf2q.quant import block_layout, from_gpu_rows, is_interleaved

TYPES = ("Q4_K", "Q4_0")
GROUP = 32
INNER_K_TILES = 8  # torch's tiling of K for its packed form (2, 4 or 8; K a multiple of 16 * this)
_PACKED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _f16(b: torch.Tensor, lo: int) -> torch.Tensor:
    return b[:, lo:lo + 2].contiguous().view(torch.float16).float()  # [blocks, 1]


def affine_codes(raw: torch.Tensor, qtype: str, shape: tuple[int, int]):
    """ggml-order rows of `qtype` as codes [n, k] (uint8, 0-15), scale and offset [n, k / 32] (fp32) with
    value = scale * code + offset, on raw's device (hf2q.quant.affine_groups does the same on the CPU in numpy,
    for all affine types)."""
    if qtype not in TYPES:
        raise ValueError(f"{qtype} is not a 4-bit affine type ({', '.join(TYPES)})")
    n, k = shape
    b = raw.reshape(-1, block_layout(qtype)[1])
    if qtype == "Q4_0":
        qs = b[:, 2:18]
        codes = torch.cat([qs & 15, qs >> 4], dim=1)
        scale = _f16(b, 0)
        offset = -8 * scale
    else:  # 8 sub-blocks: 6-bit scale and min (ggml's get_scale_min_k4), nibbles of bytes 32 (j // 2)..
        s = b[:, 4:16].long()
        low = torch.arange(4, device=b.device)
        sc = torch.cat([s[:, low] & 63, (s[:, low + 8] & 15) | ((s[:, low] >> 6) << 4)], dim=1)
        mn = torch.cat([s[:, low + 4] & 63, (s[:, low + 8] >> 4) | ((s[:, low + 4] >> 6) << 4)], dim=1)
        qs = b[:, 16:144].reshape(-1, 4, 1, 32)
        shifts = torch.tensor([0, 4], dtype=torch.uint8, device=b.device).reshape(1, 1, 2, 1)
        codes = ((qs >> shifts) & 15).reshape(-1, 256)
        scale = _f16(b, 0) * sc.float()
        offset = -(_f16(b, 2) * mn.float())
    return codes.reshape(n, k), scale.reshape(n, k // GROUP), offset.reshape(n, k // GROUP)


def pack(raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's packed codes and [k / 32, n, 2] bf16 (scale, zero) of a kept weight (interleaved K-quant rows
    are put back in ggml's order first)."""
    n, k = shape
    if is_interleaved(raw, qtype):
        raw = from_gpu_rows(raw, qtype, k)
    codes, scale, offset = affine_codes(raw, qtype, shape)
    codes = codes.to(torch.int32)
    packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), INNER_K_TILES)
    zero = offset + 8 * scale  # (code - 8) * scale + zero = scale * code + offset
    return packed, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def serves(x2: torch.Tensor, qtype: str, k: int) -> bool:
    """Whether torch's kernel takes these rows: bf16 on CUDA, a 4-bit affine type, K in whole tiles."""
    return (qtype in TYPES and x2.is_cuda and x2.dtype == torch.bfloat16
            and k % (16 * INNER_K_TILES) == 0 and k % GROUP == 0)


def int4pack_mm(x2: torch.Tensor, raw: torch.Tensor, qtype: str, n: int) -> torch.Tensor:
    """x2 [M, K] (bf16) @ W.T through torch's int4 kernel, W's packed copy built on first use (before a
    graph capture: the engine's warm-up runs every row count eagerly first) and kept while W lives."""
    key = (raw.data_ptr(), raw.device, qtype, n)
    held = _PACKED.get(key)
    if held is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("int4pack: a weight met first inside a CUDA graph capture")
        held = _PACKED[key] = (*pack(raw, qtype, (n, x2.shape[-1])), raw)
    packed, scale_zero, _ = held
    return torch._weight_int4pack_mm(x2.contiguous(), packed, GROUP, scale_zero)
