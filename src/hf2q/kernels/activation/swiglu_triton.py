"""Triton SwiGLU activation: silu(gate) * up in one kernel, reading the two halves of the packed
gate+up GEMM output in place. With QUANT the rounded output is also quantized to int8 rows for the
quantized down projection that reads it next (quant_dp4a_triton), which then needs no quantizing launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q.kernels.tuning import pdl
from hf2q.kernels.quant.int8_rows import QUANT_SLICE, int8_buffers, int8_writes, quantize_and_store, remember


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, xq_ptr, act_ptr, N, stride_g, stride_u, stride_o, BLOCK: tl.constexpr,
                     QUANT: tl.constexpr, BLOCKED: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    g = tl.load(g_ptr + row * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + c, mask=m, other=0.0).to(tl.float32)
    y = (g * tl.sigmoid(g) * u).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + row * stride_o + c, y, mask=m)
    if QUANT:  # N is a multiple of 32 (and BLOCK of 32): whole groups only
        quantize_and_store(xq_ptr, act_ptr, y, row, tl.program_id(1) * (BLOCK // 32), N // 32, BLOCK, BLOCKED)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, int8_for: str | None = None) -> torch.Tensor:
    """gate, up: [T, N] (row-strided views are fine) -> silu(gate) * up [T, N] in gate's dtype.
    int8_for: the output's int8 rows, in the order weights of that type read (int8_rows.Int8Rows),
    are written too and remembered for the mat-vec."""
    t, n = gate.shape
    assert gate.stride(1) == 1 and up.stride(1) == 1 and up.shape == gate.shape
    quantize, blocked = int8_writes(int8_for, n)
    out = torch.empty(t, n, dtype=gate.dtype, device=gate.device)
    xq, act = int8_buffers(t, n, gate.device) if quantize else (out, out)
    # Writing int8 rows, narrower programs: more of them share the quantizing (as the norm's slices).
    block = min(QUANT_SLICE if quantize else 2048, triton.next_power_of_2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate, up, out, xq, act, n, gate.stride(0), up.stride(0),
                                                 out.stride(0), BLOCK=block, QUANT=quantize, BLOCKED=blocked,
                                                 num_warps=4 if quantize else 8, **pdl.launch_options(gate.device))
    if quantize:
        remember(out, xq, act, blocked)
    return out
