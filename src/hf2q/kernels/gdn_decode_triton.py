"""Triton Gated DeltaNet decode step, fused from the conv output (or from the projection output, with the
causal conv folded in) to the input of the output projection.

One program per (sequence, value head) does, for its one new token: L2-normalise q and k (key head
h % n_k, the GGUF tiled order), the decay g = A * softplus(alpha + dt_bias) and beta = sigmoid(b), the
delta-rule update of that slot's fp32 state in place, the read-out, and the gated RMSNorm
norm(o) * w * SiLU(z). fla's recurrent kernel takes dense per-batch state; this one indexes the
per-slot state pool directly, so nothing is gathered or scattered.

The folded kernel runs one program per (sequence, key head) instead: the conv state of a q/k channel
is shared by the n_v / n_k value heads of that key head, and a program that read it while another
shifted it would race, so the program that owns the key head also owns its value heads and is the only
one that reads or writes any of their conv channels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_silu(row, conv, w_ptr, c, C):
    """SiLU(causal conv, width 4) of channels c from the slot's old state rows [3, C] and the new input,
    then the state shifted by one (the new input becomes its last row)."""
    x = tl.load(row + c).to(tl.float32)
    s0 = tl.load(conv + c)
    s1 = tl.load(conv + C + c)
    s2 = tl.load(conv + 2 * C + c)
    w0 = tl.load(w_ptr + c * 4).to(tl.float32)
    w1 = tl.load(w_ptr + c * 4 + 1).to(tl.float32)
    w2 = tl.load(w_ptr + c * 4 + 2).to(tl.float32)
    w3 = tl.load(w_ptr + c * 4 + 3).to(tl.float32)
    acc = s0.to(tl.float32) * w0 + s1.to(tl.float32) * w1 + s2.to(tl.float32) * w2 + x * w3
    # Threads may hold copies of the same channel: all reads of the old rows finish before any is overwritten.
    tl.debug_barrier()
    tl.store(conv + c, s1)
    tl.store(conv + C + c, s2)
    tl.store(conv + 2 * C + c, x)
    return acc * tl.sigmoid(acc)


@triton.jit
def _delta_step(q, k, v, b, h, slot, a_ptr, b_ptr, A_ptr, dtb_ptr, z_ptr, nw_ptr, state_ptr, out_ptr,
                stride_ab, stride_bb, stride_z, stride_out, NV, eps, DK: tl.constexpr, DV: tl.constexpr):
    """Value head h of sequence b, from its normalised q, k [DK] and v [DV]: gated delta-rule update of
    the slot's state in place, read-out, gated RMSNorm, store."""
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
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
    _delta_step(q, k, v, b, h, slot, a_ptr, b_ptr, A_ptr, dtb_ptr, z_ptr, nw_ptr, state_ptr, out_ptr,
                stride_ab, stride_bb, stride_z, stride_out, NV, eps, DK, DV)


@triton.jit
def _gdn_conv_decode_kernel(x_ptr, cw_ptr, conv_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, z_ptr, nw_ptr, state_ptr,
                            slot_ptr, out_ptr, stride_x, stride_conv, stride_ab, stride_bb, stride_z, stride_out,
                            C, NK, NV, scale, eps, DK: tl.constexpr, DV: tl.constexpr, REP: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    row = x_ptr + b * stride_x
    conv = conv_ptr + slot * stride_conv
    q = _conv_silu(row, conv, cw_ptr, kh * DK + dk, C)
    k = _conv_silu(row, conv, cw_ptr, NK * DK + kh * DK + dk, C)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    for i in tl.static_range(REP):  # the value heads of key head kh (tiled order: h = kh + i * n_k)
        h = kh + i * NK
        v = _conv_silu(row, conv, cw_ptr, 2 * NK * DK + h * DV + dv, C)
        _delta_step(q, k, v, b, h, slot, a_ptr, b_ptr, A_ptr, dtb_ptr, z_ptr, nw_ptr, state_ptr, out_ptr,
                    stride_ab, stride_bb, stride_z, stride_out, NV, eps, DK, DV)


def _check(a_raw, b_raw, z, state_pool, dk):
    assert state_pool.dtype == torch.float32 and state_pool.is_contiguous() and state_pool.shape[2] == dk
    assert z.stride(1) == 1 and a_raw.stride(1) == 1 and b_raw.stride(1) == 1


def gdn_decode_(qkv: torch.Tensor, a_raw: torch.Tensor, b_raw: torch.Tensor, A: torch.Tensor,
                dt_bias: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, state_pool: torch.Tensor,
                slots: torch.Tensor, nk: int, dk: int, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """qkv: [B, C] conv output; a_raw/b_raw: [B, nv] projections; z: [B, nv*dv]; state_pool:
    [S, nv, dk, dv] fp32, updated in place at `slots`. Returns [B, nv*dv] gated-normed core output."""
    bsz = qkv.shape[0]
    nv, dv = state_pool.shape[1], state_pool.shape[3]
    _check(a_raw, b_raw, z, state_pool, dk)
    assert qkv.stride(1) == 1
    out = torch.empty(bsz, nv * dv, dtype=out_dtype, device=qkv.device)
    _gdn_decode_kernel[(bsz, nv)](qkv, a_raw, b_raw, A, dt_bias, z, norm_w, state_pool, slots, out,
                                  qkv.stride(0), a_raw.stride(0), b_raw.stride(0), z.stride(0), out.stride(0),
                                  nk, nv, dk ** -0.5, eps, DK=dk, DV=dv, num_warps=8)
    return out


def gdn_conv_decode_(x: torch.Tensor, conv_w: torch.Tensor, conv_pool: torch.Tensor, a_raw: torch.Tensor,
                     b_raw: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor,
                     norm_w: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, nk: int, dk: int,
                     eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """gdn_decode_ with the causal conv + SiLU folded in: x [B, C] is the qkv projection before the conv;
    conv_w [C, 4]; conv_pool [S, 3, C] is updated in place at `slots` like the recurrent state."""
    bsz, c = x.shape
    nv, dv = state_pool.shape[1], state_pool.shape[3]
    _check(a_raw, b_raw, z, state_pool, dk)
    assert nv % nk == 0 and c == 2 * nk * dk + nv * dv and x.stride(1) == 1
    assert conv_w.shape == (c, 4) and conv_pool.shape[1:] == (3, c) and conv_pool.stride(2) == 1
    assert conv_pool.stride(1) == c
    out = torch.empty(bsz, nv * dv, dtype=out_dtype, device=x.device)
    _gdn_conv_decode_kernel[(bsz, nk)](x, conv_w.contiguous(), conv_pool, a_raw, b_raw, A, dt_bias, z, norm_w,
                                       state_pool, slots, out, x.stride(0), conv_pool.stride(0),
                                       a_raw.stride(0), b_raw.stride(0), z.stride(0), out.stride(0), c, nk, nv,
                                       dk ** -0.5, eps, DK=dk, DV=dv, REP=nv // nk, num_warps=4)
    return out
