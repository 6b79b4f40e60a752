"""Triton causal depthwise conv1d (K = 4) + SiLU over many tokens per sequence (prefill, chunked prefill).

Sequences lie end to end in x (`cu_seqlens`); each starts from its slot's conv state in the pool. One
program per (token block, channel block) finds each token's sequence by binary search over `cu_seqlens`
and reads its four taps from x or, before the sequence's first token, from the state. The output is
written in x's dtype, so the conv costs one read and one write of [T, C] instead of fp32 gathers and casts.

The new states are written by a second, small kernel: a sequence's first tokens read the old state while
its last tokens define the new one, and these can sit in different programs of the first kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_SEARCH_STEPS = 16  # binary search over cu_seqlens: up to 2**16 - 1 sequences, one compiled variant


# T and N vary with every step's rows and sequences: unspecialised (Triton would compile a variant for each of
# "1", "a multiple of 16" and neither, and a served step met one the warm-up had not)
@triton.jit(do_not_specialize=["T", "N"])
def _conv_varlen_kernel(x_ptr, w_ptr, state_ptr, slot_ptr, cu_ptr, y_ptr, T, C, N, stride_x, stride_ss, stride_sr,
                        stride_y, HAS_STATE: tl.constexpr, STEPS: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mt, mc = t < T, c < C
    # sequence of each token: the last i with cu[i] <= t (empty sequences are skipped over)
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + N
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        go = tl.load(cu_ptr + mid) <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    local = t - tl.load(cu_ptr + lo).to(tl.int32)  # position within its sequence
    t64 = t.to(tl.int64)
    if HAS_STATE:
        slot = tl.load(slot_ptr + lo).to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(4):
        p = local + (j - 3)  # input position of tap j; p < 0 reads state row 3 + p
        m_x = (mt & (p >= 0))[:, None] & mc[None, :]
        v = tl.load(x_ptr + (t64 + (j - 3))[:, None] * stride_x + c[None, :], mask=m_x, other=0.0).to(tl.float32)
        if HAS_STATE and j < 3:
            m_s = (mt & (p < 0))[:, None] & mc[None, :]
            s = tl.load(state_ptr + (slot * stride_ss + (3 + p) * stride_sr)[:, None] + c[None, :], mask=m_s,
                        other=0.0)
            v += s.to(x_ptr.dtype.element_ty).to(tl.float32)  # the state is rounded to x's dtype, as x is
        w = tl.load(w_ptr + c * 4 + j, mask=mc, other=0.0).to(tl.float32)
        acc += v * w[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + t64[:, None] * stride_y + c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, slot_ptr, cu_ptr, C, stride_x, stride_ss, stride_sr,
                       BLOCK_C: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < C
    start = tl.load(cu_ptr + i)
    n = tl.load(cu_ptr + i + 1) - start
    base = state_ptr + tl.load(slot_ptr + i).to(tl.int64) * stride_ss
    r0 = _state_row(x_ptr, base, start, n, c, mc, stride_x, stride_sr, 0)
    r1 = _state_row(x_ptr, base, start, n, c, mc, stride_x, stride_sr, 1)
    r2 = _state_row(x_ptr, base, start, n, c, mc, stride_x, stride_sr, 2)
    tl.store(base + c, r0.to(state_ptr.dtype.element_ty), mask=mc)
    tl.store(base + stride_sr + c, r1.to(state_ptr.dtype.element_ty), mask=mc)
    tl.store(base + 2 * stride_sr + c, r2.to(state_ptr.dtype.element_ty), mask=mc)


@triton.jit
def _state_row(x_ptr, base, start, n, c, mc, stride_x, stride_sr, r: tl.constexpr):
    """Row r of a sequence's new state: input n - 3 + r, or old row r + n when the sequence is shorter."""
    p = n - 3 + r + c * 0  # as a vector, so the masks are vectors
    xv = tl.load(x_ptr + (start + p) * stride_x + c, mask=mc & (p >= 0), other=0.0)
    sv = tl.load(base + (r + n) * stride_sr + c, mask=mc & (p < 0), other=0.0)
    return tl.where(p >= 0, xv, sv.to(x_ptr.dtype.element_ty))


def conv_varlen_(x: torch.Tensor, weight: torch.Tensor, state_pool: Optional[torch.Tensor],
                 slots: Optional[torch.Tensor], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """x: [T, C] new inputs of N sequences end to end (rows may be strided); weight: [C, 4];
    state_pool: [S, 3, C] previous raw inputs, read and updated in place at `slots` [N] (None = zero
    states, nothing written); cu_seqlens: [N + 1]. Returns SiLU(conv) [T, C] in x's dtype."""
    t, c = x.shape
    n = cu_seqlens.shape[0] - 1
    assert weight.shape == (c, 4) and x.stride(1) == 1
    y = torch.empty(t, c, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return y
    w = weight.contiguous()
    has_state = state_pool is not None
    if has_state:
        assert state_pool.shape[1:] == (3, c) and state_pool.stride(2) == 1 and slots.shape[0] == n
    pool = state_pool if has_state else x
    ss, sr = (state_pool.stride(0), state_pool.stride(1)) if has_state else (0, 0)
    assert n < 1 << _SEARCH_STEPS
    block_t, block_c = 32, 128
    _conv_varlen_kernel[(triton.cdiv(t, block_t), triton.cdiv(c, block_c))](
        x, w, pool, slots if has_state else cu_seqlens, cu_seqlens, y, t, c, n, x.stride(0), ss, sr, y.stride(0),
        HAS_STATE=has_state, STEPS=_SEARCH_STEPS, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    if has_state:
        block = 512
        _conv_state_kernel[(n, triton.cdiv(c, block))](x, state_pool, slots, cu_seqlens, c, x.stride(0), ss, sr,
                                                        BLOCK_C=block, num_warps=4)
    return y
