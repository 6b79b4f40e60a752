"""Triton residual add + RMSNorm: the pre-norm of every decoder block in one pass over the row.

`residual + x` is rounded to the residual dtype (as the unfused `x + y` is) and both the new residual and
its norm are written, so the block reads the hidden state once instead of through seven small kernels.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, res_ptr, y_ptr, N, stride_x, stride_r, stride_res, stride_y, eps,
                         HAS_R: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0)
    if HAS_R:
        r = tl.load(r_ptr + row * stride_r + c, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + c, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + c, (xf * inv * w).to(y_ptr.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, add: Optional[torch.Tensor], weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, add: [T, N] -> (x + add, rms_norm(x + add) * weight), both in x's dtype; add None: (x, norm(x))."""
    t, n = x.shape
    assert x.stride(1) == 1 and (add is None or (add.shape == x.shape and add.stride(1) == 1))
    y = torch.empty_like(x)
    res = torch.empty_like(x) if add is not None else x
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(t,)](x, add if add is not None else x, weight, res, y, n, x.stride(0),
                               add.stride(0) if add is not None else 0, res.stride(0), y.stride(0), eps,
                               HAS_R=add is not None, BLOCK=block, num_warps=min(16, max(4, block // 512)))
    return res, y
