"""Multiplying by GGUF-quantized weights: picks the Triton kernel or the exact reference, by device.

Up to MATVEC_ROWS rows (decode of up to four sequences; MoE token-expert pairs, up to MOE_PAIRS) go through
the mat-vec kernel that streams the blocks and multiplies them on 8-bit integer dot products against
int8-quantized activations (dp4a_triton): K-quant weights at 2-4 rows are unpacked once for all rows (its
shared rows), Q8_0 and Q4_0 likewise, but each row still costs its own dot products. Up to MM_ROWS rows go
through mm_triton, which dequantizes 32-value groups in registers and multiplies them on tensor cores,
reading the blocks once for all rows (on the H200, a 9B Q4_K_M step's projections: 6.6 ms at 16 rows
and 11.0 ms at 64, against 13.7 ms for dequantize + cuBLAS; BENCHMARKS.md); with HF2Q_QUANT_MM=mmq,
Q8_0 and K-quant rows go instead through mmq_triton's int8 tensor-core dots on int8-quantized
activations (the mat-vec's numerics; off by default until measured). More rows (prefill)
dequantize the weight into a reused bf16 scratch buffer and multiply with cuBLAS: one pass over the
weight, then tensor cores at full rate. Off CUDA (and without Triton's interpreter) the reference
dequantizes with gguf and multiplies in fp32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hf2q import envs
from hf2q.kernels.choose import triton_runs
from hf2q.quant import KQUANTS, dequantize_ref, is_interleaved, kept_row

# At most this many rows go through the int8 mat-vec kernel (its shared rows stop at 4). On the H200, the
# default configurations of three projections that hold 3.03 GB of a 9B Q4_K_M token (Q5_K DeltaNet qkv, Q4_K
# gate+up, Q6_K down; `HF2Q_GEMV_TUNE=0 python -m hf2q.bench.quant --no-prefill --rows 2 4 --only gdn.qkv
# ffn.gate+up ffn.down`): 1.14 ms at one row, 1.49 at 2, 2.02 at 4 (before shared rows and K constants: 1.16,
# 1.90, 5.04; BENCHMARKS.md). Past 4 rows the tile kernels take over (a whole 9B Q4_K_M step's projections on
# units of one row each took 25 ms at 8 rows against 13.5 ms for dequantize + cuBLAS: tools/quant_mm_sweep.py
# --matvec).
MATVEC_ROWS = 4
MM_ROWS = 64  # at most this many rows go through mm_triton (one pass over the blocks for all rows)
# "mmq": Q8_0 and K-quant rows up to MM_ROWS on int8 tensor cores (mmq_triton); "packed": the tile kernel's bf16 fmas
QUANT_MM = envs.quant_mm()
MOE_PAIRS = 1024  # token-expert pairs below which reading chosen experts beats dequantizing every expert
_SCRATCH: dict[tuple, torch.Tensor] = {}


def int8_reader(x: torch.Tensor, qtype: str | None) -> str | None:
    """`qtype` if a projection of x quantized as `qtype` (None: not quantized) reads x as int8 rows (the
    int8 mat-vec; with HF2Q_QUANT_MM=mmq, mmq_triton's types up to MM_ROWS rows), so that the kernel
    producing x can write its int8 rows as well, in the order that type reads; else None."""
    if qtype is None or not triton_runs(x):
        return None
    rows = x.numel() // max(x.shape[-1], 1)
    if rows <= MATVEC_ROWS or (rows <= MM_ROWS and QUANT_MM == "mmq" and qtype in _mmq_types()):
        return qtype
    return None


def _mmq_types() -> tuple[str, ...]:
    from hf2q.kernels.quant.mmq_triton import TYPES

    return TYPES


def check_raw(raw: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> None:
    """Fail loudly unless raw holds exactly `shape` values of `qtype` as a kept weight: uint8 [..., rows,
    row_bytes] in ggml's order, or for K-quants interleaved int32 rows (hf2q.quant.keep_blocks), which CUDA
    needs."""
    interleaved = is_interleaved(raw, qtype)
    dtype, width = kept_row(qtype, shape[-1], interleaved)
    want = (*shape[:-1], width)
    if raw.dtype != dtype or tuple(raw.shape) != want or not raw.is_contiguous():
        raise ValueError(f"{qtype} weight of shape {tuple(shape)} needs contiguous {dtype} {want}, "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    if qtype in KQUANTS and raw.is_cuda and not interleaved:
        raise ValueError(f"{qtype} blocks on CUDA are kept as interleaved rows: lay them out with "
                         "hf2q.quant.keep_blocks")


def scratch(slot: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A flat buffer reused across calls (stream order makes reuse safe); grows, never shrinks."""
    key = (slot, str(device), dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def dequantize(raw: torch.Tensor, qtype: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Values of a quantized tensor [..., rows, row_bytes] as `dtype` of `shape`."""
    if not triton_runs(raw):
        value = dequantize_ref(raw, qtype, shape).to(device=raw.device, dtype=dtype)
        return value if out is None else out.view(shape).copy_(value)
    from hf2q.kernels.quant import dequant_triton as quant_triton

    rows, k = math.prod(shape[:-1]), shape[-1]
    out = torch.empty(shape, dtype=dtype, device=raw.device) if out is None else out.view(shape)
    quant_triton.dequantize(raw, qtype, rows, k, out)
    return out


def quant_linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, out_features: int) -> torch.Tensor:
    """x [..., in] @ W.T for W quantized as raw [out, row_bytes]; result in x's dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if not triton_runs(x):
        w = dequantize_ref(raw, qtype, (out_features, k)).to(x.device)
        return F.linear(x2.float(), w).to(x.dtype).reshape(*x.shape[:-1], out_features)
    if x2.shape[0] <= MATVEC_ROWS:
        from hf2q.kernels.quant.dp4a_triton import gemv

        y = gemv(x2, raw, qtype, out_features, key=x)
    elif x2.shape[0] <= MM_ROWS:
        y = _batched(x2, raw, qtype, out_features, key=x)
    else:
        w = dequantize(raw, qtype, (out_features, k), x.dtype,
                       out=scratch("linear", out_features * k, x.dtype, x.device))
        y = F.linear(x2, w)
    return y.reshape(*x.shape[:-1], out_features)


def _batched(x2: torch.Tensor, raw: torch.Tensor, qtype: str, n: int, key: torch.Tensor) -> torch.Tensor:
    """Up to MM_ROWS rows x2 [M, K] @ W.T: mmq_triton's int8 dots where HF2Q_QUANT_MM=mmq and it reads the
    type, else mm_triton's bf16 tiles (K-quant values by bf16 fmas where HF2Q_QUANT_MM=packed)."""
    if QUANT_MM == "mmq" and qtype in _mmq_types():
        from hf2q.kernels.quant.mmq_triton import quant_mmq

        return quant_mmq(x2, raw, qtype, n, key=key)
    from hf2q.kernels.quant.mm_triton import quant_mm

    return quant_mm(x2, raw, qtype, n, packed=QUANT_MM == "packed")


def quant_linear_pair(x: torch.Tensor, first: tuple, second: tuple) -> torch.Tensor | None:
    """x [..., in] times two quantized weights (raw, qtype, out_features) of different types, in one int8
    mat-vec launch -> [..., n1 + n2] in x's dtype; None where that launch does not serve: no Triton, too
    many rows, types that read activations in different orders, or a first weight whose rows do not
    split into whole programs (a multiple of 32). (K-quant rows are whole 256-value blocks by type.)"""
    from hf2q.kernels.quant.dp4a_triton import matvec
    from hf2q.kernels.quant.int8_rows import blocked_for, quantize_rows

    (raw1, qtype1, n1), (raw2, qtype2, n2) = first, second
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if not triton_runs(x) or x2.shape[0] > MATVEC_ROWS or blocked_for(qtype1) != blocked_for(qtype2) or n1 % 32:
        return None
    y = matvec(quantize_rows(x2, x, blocked_for(qtype1)), raw1, qtype1, n1, out_dtype=x.dtype,
               second=(raw2, n2, qtype2))
    return y.reshape(*x.shape[:-1], n1 + n2)

