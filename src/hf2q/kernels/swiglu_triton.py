"""Triton SwiGLU activation: silu(gate) * up in one kernel, reading the two halves of the packed
gate+up GEMM output in place."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, N, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    g = tl.load(g_ptr + row * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + c, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + c, (g * tl.sigmoid(g) * u).to(o_ptr.dtype.element_ty), mask=m)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [T, N] (row-strided views are fine) -> silu(gate) * up [T, N] in gate's dtype."""
    t, n = gate.shape
    assert gate.stride(1) == 1 and up.stride(1) == 1 and up.shape == gate.shape
    out = torch.empty(t, n, dtype=gate.dtype, device=gate.device)
    block = 2048
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0),
                                                 BLOCK=block, num_warps=8)
    return out
