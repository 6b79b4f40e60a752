"""Triton kernels around MoE experts: routing (softmax, top-k, renormalise) and the combine (weighted sum
of each token's expert outputs plus the gated shared expert), one launch each instead of a chain of
small torch ops per layer (a decode step of a 40-layer MoE runs each 40 times).

Softmax over all experts followed by renormalising the top k is the softmax over the top k logits, so
routing picks the k largest logits (first index on ties) and normalises them in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q.kernels.tuning import pdl


@triton.jit
def _route_kernel(logit_ptr, w_ptr, e_ptr, E, stride, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                  BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_E)
    logits = tl.load(logit_ptr + t * stride + i, mask=i < E, other=float("-inf")).to(tl.float32)
    j = tl.arange(0, TOPK_P2)
    vals = tl.full((TOPK_P2,), float("-inf"), tl.float32)
    idxs = tl.zeros((TOPK_P2,), tl.int32)
    for step in tl.static_range(TOPK):
        best = tl.max(logits, axis=0)
        at = tl.argmax(logits, axis=0, tie_break_left=True)
        vals = tl.where(j == step, best, vals)
        idxs = tl.where(j == step, at, idxs)
        logits = tl.where(i == at, float("-inf"), logits)
    p = tl.exp(vals - tl.max(vals, axis=0))  # padding entries: exp(-inf) = 0
    p = p / tl.sum(p, axis=0)
    tl.store(w_ptr + t * TOPK + j, p.to(w_ptr.dtype.element_ty), mask=j < TOPK)
    tl.store(e_ptr + t * TOPK + j, idxs, mask=j < TOPK)


def route(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in dtype, experts [T, k] int32), largest logit first."""
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=dtype, device=logits.device)
    experts = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        # One warp a token: its 2·k dependent reductions over the experts stay in warp shuffles (four warps
        # would add a shared-memory round trip and a barrier to each).
        _route_kernel[(t,)](logits, weights, experts, e, logits.stride(0), TOPK=top_k,
                            TOPK_P2=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(e), num_warps=1,
                            **pdl.launch_options(logits.device))
    return weights, experts


@triton.jit
def _combine_kernel(y_ptr, w_ptr, s_ptr, g_ptr, out_ptr, H, s_stride, g_stride, TOPK: tl.constexpr,
                    HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOPK):
        w = tl.load(w_ptr + t * TOPK + j).to(tl.float32)
        acc += w * tl.load(y_ptr + (t * TOPK + j) * H + c, mask=ok, other=0).to(tl.float32)
    if HAS_SHARED:
        gate = tl.sigmoid(tl.load(g_ptr + t * g_stride).to(tl.float32))
        acc += gate * tl.load(s_ptr + t * s_stride + c, mask=ok, other=0).to(tl.float32)
    tl.store(out_ptr + t * H + c, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
            shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k weights[t, k] · y[t·k + k] (+ sigmoid(shared_gate[t]) · shared[t]) -> [T, H] in y's dtype.

    y: [T·k, H] contiguous pair outputs; shared [T, H] and shared_gate [T, 1] may be row-strided views."""
    t, top_k = weights.shape
    h = y.shape[1]
    assert y.is_contiguous() and y.shape[0] == t * top_k and weights.is_contiguous()
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    has_shared = shared is not None
    if has_shared:
        assert shared.stride(1) == 1 and shared.shape == (t, h) and shared_gate.shape[0] == t
    s = shared if has_shared else y
    g = shared_gate if has_shared else y
    block = min(2048, triton.next_power_of_2(h))
    if t:
        _combine_kernel[(t, triton.cdiv(h, block))](y, weights, s, g, out, h, s.stride(0), g.stride(0), TOPK=top_k,
                                                    HAS_SHARED=has_shared, BLOCK=block, num_warps=4,
                                                    **pdl.launch_options(y.device))
    return out
