"""Triton residual add + RMSNorm: the pre-norm of every decoder block in one pass over the row.

`residual + x` is rounded to the residual dtype (as the unfused `x + y` is) and both the new residual and
its norm are written, so the block reads the hidden state once instead of through seven small kernels.
With QUANT, the norm's rounded output is also quantized to int8 rows for the quantized mat-vec that
reads it next (quant_dp4a_triton), which then needs no quantizing launch of its own.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hf2q.kernels.tuning import pdl
from hf2q.kernels.quant.int8_rows import QUANT_SLICE, int8_buffers, int8_writes, quantize_and_store, remember


@triton.jit
def _residual(x_ptr, r_ptr, res_ptr, row, stride_x, stride_r, c, m, HAS_R: tl.constexpr):
    """Columns c of the row of x, plus those of r rounded to the residual's dtype (with HAS_R)."""
    x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0)
    if HAS_R:
        r = tl.load(r_ptr + row * stride_r + c, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
    return x


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, res_ptr, y_ptr, xq_ptr, act_ptr, N, stride_x, stride_r, stride_res,
                         stride_y, eps, HAS_R: tl.constexpr, BLOCK: tl.constexpr, SLICE: tl.constexpr,
                         QUANT: tl.constexpr, BLOCKED: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, part): the row's inverse RMS from the whole row, then its outputs for columns
    part·SLICE .. (SLICE = BLOCK: the whole row in one program)."""
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = _residual(x_ptr, r_ptr, res_ptr, row, stride_x, stride_r, c, m, HAS_R)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    if SLICE < BLOCK:  # this program's columns again, from L1/L2: a register tile cannot be sliced
        c = tl.program_id(1) * SLICE + tl.arange(0, SLICE)
        m = c < N
        x = _residual(x_ptr, r_ptr, res_ptr, row, stride_x, stride_r, c, m, HAS_R)
        xf = x.to(tl.float32)
    if HAS_R:
        tl.store(res_ptr + row * stride_res + c, x, mask=m)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    y = (xf * inv * w).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + c, y, mask=m)
    if QUANT:  # N and SLICE are multiples of 32: whole groups only
        quantize_and_store(xq_ptr, act_ptr, y, row, tl.program_id(1) * (SLICE // 32), N // 32, SLICE, BLOCKED)


def add_rms_norm(x: torch.Tensor, add: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                 int8_for: str | None = None, slice_width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, add: [T, N] -> (x + add, rms_norm(x + add) * weight), both in x's dtype; add None: (x, norm(x)).
    int8_for: the norm's int8 rows, in the order weights of that type read (int8_rows.Int8Rows),
    are written too and remembered for the mat-vec, by programs of slice_width columns each (a power of
    two dividing N; default QUANT_SLICE where it divides a wider N, else the whole row)."""
    t, n = x.shape
    assert x.stride(1) == 1 and (add is None or (add.shape == x.shape and add.stride(1) == 1))
    quantize, blocked = int8_writes(int8_for, n)
    y = torch.empty_like(x)
    res = torch.empty_like(x) if add is not None else x
    xq, act = int8_buffers(t, n, x.device) if quantize else (y, y)
    block = triton.next_power_of_2(n)
    if not quantize:
        width = block
    elif slice_width is None:
        # each program takes a slice of the quantizing (all of them compute the row's RMS)
        width = QUANT_SLICE if n > QUANT_SLICE and n % QUANT_SLICE == 0 else block
    else:
        assert n % slice_width == 0 and slice_width % 32 == 0 and slice_width & (slice_width - 1) == 0
        width = slice_width
    _add_rms_norm_kernel[(t, triton.cdiv(n, width))](
        x, add if add is not None else x, weight, res, y, xq, act, n, x.stride(0),
        add.stride(0) if add is not None else 0, res.stride(0), y.stride(0), eps, HAS_R=add is not None,
        BLOCK=block, SLICE=width, QUANT=quantize, BLOCKED=blocked, num_warps=min(16, max(4, block // 512)),
        **pdl.launch_options(x.device))
    if quantize:
        remember(y, xq, act, blocked)
    return res, y
