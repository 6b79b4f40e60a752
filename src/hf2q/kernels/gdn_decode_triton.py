"""Triton Gated DeltaNet decode step, fused from the conv output to the input of the output projection.

One program per (sequence, value head) does, for its one new token: L2-normalise q and k (key head
h % n_k, the GGUF tiled order), the decay g = A * softplus(alpha + dt_bias) and beta = sigmoid(b), the
delta-rule update of that slot's fp32 state in place, the read-out, and the gated RMSNorm
norm(o) * w * SiLU(z). fla's recurrent kernel takes dense per-batch state; this one indexes the
per-slot state pool directly, so nothing is gathered or scattered.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_decode_kernel(qkv_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, z_ptr, nw_ptr, state_ptr, slot_ptr, out_ptr,
                       stride_qkv, stride_ab, stride_bb, stride_z, stride_out, NK, NV, scale, eps,
                       DK: tl.constexpr, DV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = h % NK
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    row = qkv_ptr + b * stride_qkv
    q = tl.load(row + kh * DK + dk).to(tl.float32)
    k = tl.load(row + NK * DK + kh * DK + dk).to(tl.float32)
    v = tl.load(row + 2 * NK * DK + h * DV + dv).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    a = tl.load(a_ptr + b * stride_ab + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    decay = tl.exp(tl.load(A_ptr + h).to(tl.float32) * softplus)
    beta = tl.sigmoid(tl.load(b_ptr + b * stride_bb + h).to(tl.float32))
    sp = state_ptr + (slot * NV + h) * (DK * DV) + dk[:, None] * DV + dv[None, :]
    s = tl.load(sp) * decay
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(sp, s)
    o = tl.sum(s * q[:, None], 0)
    o = o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps) * tl.load(nw_ptr + dv).to(tl.float32)
    z = tl.load(z_ptr + b * stride_z + h * DV + dv).to(tl.float32)
    tl.store(out_ptr + b * stride_out + h * DV + dv, o * z * tl.sigmoid(z))


def gdn_decode_(qkv: torch.Tensor, a_raw: torch.Tensor, b_raw: torch.Tensor, A: torch.Tensor,
                dt_bias: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, state_pool: torch.Tensor,
                slots: torch.Tensor, nk: int, dk: int, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """qkv: [B, C] conv output; a_raw/b_raw: [B, nv] projections; z: [B, nv*dv]; state_pool:
    [S, nv, dk, dv] fp32, updated in place at `slots`. Returns [B, nv*dv] gated-normed core output."""
    bsz = qkv.shape[0]
    nv, dv = state_pool.shape[1], state_pool.shape[3]
    assert state_pool.dtype == torch.float32 and state_pool.is_contiguous() and state_pool.shape[2] == dk
    assert qkv.stride(1) == 1 and z.stride(1) == 1 and a_raw.stride(1) == 1 and b_raw.stride(1) == 1
    out = torch.empty(bsz, nv * dv, dtype=out_dtype, device=qkv.device)
    _gdn_decode_kernel[(bsz, nv)](qkv, a_raw, b_raw, A, dt_bias, z, norm_w, state_pool, slots, out,
                                  qkv.stride(0), a_raw.stride(0), b_raw.stride(0), z.stride(0), out.stride(0),
                                  nk, nv, dk ** -0.5, eps, DK=dk, DV=dv, num_warps=8)
    return out
