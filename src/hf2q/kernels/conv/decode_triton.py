"""Triton causal conv1d + SiLU for one decode token per sequence, updating each slot's conv state in place.

One program per (sequence, channel block): reads K-1 state rows and the new input, writes SiLU(conv) and
the shifted state. Written for the Qwen3.5 kernel width K = 4.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_decode_kernel(x_ptr, w_ptr, state_ptr, slot_ptr, y_ptr, C, stride_xb, stride_ss, stride_yb,
                        BLOCK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    base = state_ptr + slot * stride_ss
    x = tl.load(x_ptr + b * stride_xb + c, mask=m, other=0.0).to(tl.float32)
    s0 = tl.load(base + c, mask=m, other=0.0)
    s1 = tl.load(base + C + c, mask=m, other=0.0)
    s2 = tl.load(base + 2 * C + c, mask=m, other=0.0)
    w0 = tl.load(w_ptr + c * 4, mask=m, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + c * 4 + 1, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + c * 4 + 2, mask=m, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + c * 4 + 3, mask=m, other=0.0).to(tl.float32)
    acc = s0.to(tl.float32) * w0 + s1.to(tl.float32) * w1 + s2.to(tl.float32) * w2 + x * w3
    tl.store(base + c, s1, mask=m)
    tl.store(base + C + c, s2, mask=m)
    tl.store(base + 2 * C + c, x, mask=m)
    tl.store(y_ptr + b * stride_yb + c, acc * tl.sigmoid(acc), mask=m)


def conv_decode_(x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor
                 ) -> torch.Tensor:
    """x: [B, C] one new input per sequence; weight: [C, 4]; state_pool: [S, 3, C] (updated in place at
    `slots`). Returns SiLU(conv) [B, C] fp32."""
    b, c = x.shape
    assert weight.shape[1] == 4 and state_pool.shape[1] == 3 and state_pool.stride(2) == 1
    assert x.stride(1) == 1 and state_pool.stride(1) == c
    w = weight.contiguous()
    y = torch.empty(b, c, dtype=torch.float32, device=x.device)
    block = 1024
    _conv_decode_kernel[(b, triton.cdiv(c, block))](x, w, state_pool, slots, y, c, x.stride(0),
                                                     state_pool.stride(0), y.stride(0), BLOCK=block)
    return y
