"""Triton Gated DeltaNet decode step, fused from the conv output (or from the projection output, with the
causal conv folded in) to the input of the output projection.

One program per (sequence, value head) does, for its one new token: L2-normalise q and k (key head
h % n_k, the GGUF tiled order), the decay g = A * softplus(alpha + dt_bias) and beta = sigmoid(b), the
delta-rule update of that slot's state in place (fp32 or bf16 in the pool, fp32 in registers: rounded once
as it is stored), the read-out, and the gated RMSNorm
norm(o) * w * SiLU(z). fla's recurrent kernel takes dense per-batch state; this one indexes the
per-slot state pool directly, so nothing is gathered or scattered.

With the causal conv folded in, the step is two kernels. The first runs one program per (sequence,
value head, quarter of the head's columns): at batch 1 a 9B layer's 2 MB of state is then walked by 128
programs instead of 16, and each column of the delta rule needs only its own column of the state. It
reads the q/k conv channels without shifting them (every program of a key head reads them) and shifts
only the value channels it owns; it leaves its columns' read-out and their sum of squares in scratch.
The second, one program per (sequence, value head), applies the gated RMSNorm over the whole head, and
the programs of the first n_k heads shift their key head's q/k conv channels, now that every reader has
finished (a launch boundary is the only grid-wide barrier Triton has).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q.kernels.tuning import pdl
from hf2q.kernels.quant.int8_rows import int8_buffers, int8_writes, quantize_and_store, remember


@triton.jit
def _conv_out(row, conv, w_ptr, c, C):
    """SiLU(causal conv, width 4) of channels c from the slot's state rows [3, C] and the new input."""
    x = tl.load(row + c).to(tl.float32)
    acc = x * tl.load(w_ptr + c * 4 + 3).to(tl.float32)
    for i in tl.static_range(3):
        acc += tl.load(conv + i * C + c).to(tl.float32) * tl.load(w_ptr + c * 4 + i).to(tl.float32)
    return acc * tl.sigmoid(acc)


@triton.jit
def _conv_shift(row, conv, c, C):
    """Shift channels c of the slot's conv state by one: the new input becomes its last row."""
    x = tl.load(row + c)
    s1 = tl.load(conv + C + c)
    s2 = tl.load(conv + 2 * C + c)
    # Threads may hold copies of the same channel: all reads of the old rows finish before any is overwritten.
    tl.debug_barrier()
    tl.store(conv + c, s1)
    tl.store(conv + C + c, s2)
    tl.store(conv + 2 * C + c, x)


@triton.jit
def _decay_beta(a_ptr, b_ptr, A_ptr, dtb_ptr, b, h, stride_ab, stride_bb):
    """Head h's decay exp(A · softplus(alpha + dt_bias)) and beta = sigmoid(b) for sequence b."""
    alpha = tl.load(a_ptr + b * stride_ab + h).to(tl.float32)
    b_raw = tl.load(b_ptr + b * stride_bb + h).to(tl.float32)
    return _decay_beta_of(alpha, b_raw, tl.load(A_ptr + h).to(tl.float32), tl.load(dtb_ptr + h).to(tl.float32))


@triton.jit
def _decay_beta_of(alpha, b, A, dt_bias):
    """exp(A · softplus(alpha + dt_bias)) and sigmoid(b) from the loaded values (fp32): the verify kernel loads a
    row's ahead of its use."""
    a = alpha + dt_bias
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    return tl.exp(A * softplus), tl.sigmoid(b)


@triton.jit
def _delta_columns(q, k, v, decay, beta, state, dk, dv, DV: tl.constexpr):
    """Columns dv of one head's state [DK, DV] at `state` (the pool's dtype): the gated delta-rule update in place
    in fp32 (each column needs only itself), and their read-out o[dv] = Σ_k state'[k, dv] q[k]."""
    sp = state + dk[:, None] * DV + dv[None, :]
    s = tl.load(sp).to(tl.float32) * decay
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(sp, s.to(sp.dtype.element_ty))
    return tl.sum(s * q[:, None], 0)


@triton.jit
def _gated_norm_store(o, ss, b, h, dv, z_ptr, nw_ptr, out_ptr, stride_z, stride_out, eps, DV: tl.constexpr):
    """norm(o) · w · SiLU(z) of head h's read-out o [DV] (ss = Σ o²), stored at the head's columns; returns
    the stored (rounded) values."""
    o = o * tl.rsqrt(ss / DV + eps) * tl.load(nw_ptr + dv).to(tl.float32)
    z = tl.load(z_ptr + b * stride_z + h * DV + dv).to(tl.float32)
    y = (o * z * tl.sigmoid(z)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_out + h * DV + dv, y)
    return y


@triton.jit
def _delta_step(q, k, v, b, h, slot, a_ptr, b_ptr, A_ptr, dtb_ptr, z_ptr, nw_ptr, state_ptr, out_ptr,
                stride_ab, stride_bb, stride_z, stride_out, NV, eps, DK: tl.constexpr, DV: tl.constexpr):
    """Value head h of sequence b, from its normalised q, k [DK] and v [DV]: gated delta-rule update of
    the slot's state in place, read-out, gated RMSNorm, store."""
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    decay, beta = _decay_beta(a_ptr, b_ptr, A_ptr, dtb_ptr, b, h, stride_ab, stride_bb)
    o = _delta_columns(q, k, v, decay, beta, state_ptr + (slot * NV + h) * (DK * DV), dk, dv, DV)
    _gated_norm_store(o, tl.sum(o * o, 0), b, h, dv, z_ptr, nw_ptr, out_ptr, stride_z, stride_out, eps, DV)


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
def _gdn_conv_columns_kernel(x_ptr, cw_ptr, conv_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slot_ptr, o_ptr,
                             ss_ptr, stride_x, stride_conv, stride_ab, stride_bb, C, NK, NV, scale, eps,
                             DK: tl.constexpr, DV: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
    """Program (b, h, j): columns j·DV/SPLIT .. of value head h for sequence b, up to the read-out (o and
    its partial Σ o² into scratch); shifts the conv state of its own value channels only."""
    pdl.enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    kh = h % NK  # tiled order: value head h reads key head h % n_k
    BDV: tl.constexpr = DV // SPLIT
    dk = tl.arange(0, DK)
    dv = j * BDV + tl.arange(0, BDV)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    row = x_ptr + b * stride_x
    conv = conv_ptr + slot * stride_conv
    q = _conv_out(row, conv, cw_ptr, kh * DK + dk, C)
    k = _conv_out(row, conv, cw_ptr, NK * DK + kh * DK + dk, C)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    v_ch = 2 * NK * DK + h * DV + dv
    v = _conv_out(row, conv, cw_ptr, v_ch, C)
    _conv_shift(row, conv, v_ch, C)
    decay, beta = _decay_beta(a_ptr, b_ptr, A_ptr, dtb_ptr, b, h, stride_ab, stride_bb)
    o = _delta_columns(q, k, v, decay, beta, state_ptr + (slot * NV + h) * (DK * DV), dk, dv, DV)
    pair = b * NV + h
    tl.store(o_ptr + pair * DV + dv, o)
    tl.store(ss_ptr + pair * SPLIT + j, tl.sum(o * o, 0))


@triton.jit
def _gdn_conv_finish_kernel(x_ptr, conv_ptr, z_ptr, nw_ptr, slot_ptr, o_ptr, ss_ptr, out_ptr, xq_ptr, act_ptr,
                            stride_x, stride_conv, stride_z, stride_out, C, NK, NV, eps, DK: tl.constexpr,
                            DV: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr, BLOCKED: tl.constexpr,
                            PDL: tl.constexpr = False):
    """Program (b, h): the gated RMSNorm of head h's read-out (with QUANT also its int8 rows for the
    quantized output projection, int8_rows.quantize_and_store); programs h < n_k also shift key
    head h's q/k conv channels (every reader of them ran in the previous launch)."""
    pdl.enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.arange(0, DV)
    pair = b * NV + h
    ss = tl.sum(tl.load(ss_ptr + pair * SPLIT + tl.arange(0, SPLIT)), 0)
    y = _gated_norm_store(tl.load(o_ptr + pair * DV + dv), ss, b, h, dv, z_ptr, nw_ptr, out_ptr, stride_z,
                          stride_out, eps, DV)
    if QUANT:  # DV is a multiple of 32: a head holds whole groups
        quantize_and_store(xq_ptr, act_ptr, y, b, h * (DV // 32), NV * (DV // 32), DV, BLOCKED)
    if h < NK:
        dk = tl.arange(0, DK)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        row = x_ptr + b * stride_x
        conv = conv_ptr + slot * stride_conv
        _conv_shift(row, conv, h * DK + dk, C)
        _conv_shift(row, conv, NK * DK + h * DK + dk, C)


def _check(a_raw, b_raw, z, state_pool, dk):
    assert state_pool.dtype in (torch.float32, torch.bfloat16) and state_pool.is_contiguous()
    assert state_pool.shape[2] == dk
    assert z.stride(1) == 1 and a_raw.stride(1) == 1 and b_raw.stride(1) == 1


def gdn_decode_(qkv: torch.Tensor, a_raw: torch.Tensor, b_raw: torch.Tensor, A: torch.Tensor,
                dt_bias: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, state_pool: torch.Tensor,
                slots: torch.Tensor, nk: int, dk: int, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """qkv: [B, C] conv output; a_raw/b_raw: [B, nv] projections; z: [B, nv*dv]; state_pool:
    [S, nv, dk, dv] fp32 or bf16, updated in place at `slots`. Returns [B, nv*dv] gated-normed core output."""
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
                     eps: float, out_dtype: torch.dtype, int8_for: str | None = None,
                     config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """gdn_decode_ with the causal conv + SiLU folded in: x [B, C] is the qkv projection before the conv;
    conv_w [C, 4]; conv_pool [S, 3, C] is updated in place at `slots` like the recurrent state. int8_for:
    the output's int8 rows, in the order weights of that type read, are written too and remembered for the
    quantized output projection. config: (column parts a head, warps of the first kernel, of the second),
    default DEFAULT_CONFIG (bench.gdn times others)."""
    bsz, c = x.shape
    nv, dv = state_pool.shape[1], state_pool.shape[3]
    _check(a_raw, b_raw, z, state_pool, dk)
    assert nv % nk == 0 and c == 2 * nk * dk + nv * dv and x.stride(1) == 1
    assert conv_w.shape == (c, 4) and conv_pool.shape[1:] == (3, c) and conv_pool.stride(2) == 1
    assert conv_pool.stride(1) == c
    out = torch.empty(bsz, nv * dv, dtype=out_dtype, device=x.device)
    split, warps_columns, warps_finish = config or DEFAULT_CONFIG
    split = split if dv % split == 0 else 1
    o = torch.empty(bsz, nv, dv, dtype=torch.float32, device=x.device)
    ss = torch.empty(bsz, nv, split, dtype=torch.float32, device=x.device)
    _gdn_conv_columns_kernel[(bsz, nv, split)](x, conv_w.contiguous(), conv_pool, a_raw, b_raw, A, dt_bias,
                                               state_pool, slots, o, ss, x.stride(0), conv_pool.stride(0),
                                               a_raw.stride(0), b_raw.stride(0), c, nk,
                                               nv, dk ** -0.5, eps, DK=dk, DV=dv, SPLIT=split,
                                               num_warps=warps_columns, **pdl.launch_options(x.device))
    quantize, blocked = int8_writes(int8_for, nv * dv)
    quantize = quantize and dv % 32 == 0  # a program's head holds whole groups
    xq, act = int8_buffers(bsz, nv * dv, x.device) if quantize else (out, out)
    _gdn_conv_finish_kernel[(bsz, nv)](x, conv_pool, z, norm_w, slots, o, ss, out, xq, act, x.stride(0),
                                       conv_pool.stride(0), z.stride(0), out.stride(0), c, nk, nv, eps, DK=dk, DV=dv,
                                       SPLIT=split, QUANT=quantize, BLOCKED=blocked, num_warps=warps_finish,
                                       **pdl.launch_options(x.device))
    if quantize:
        remember(out, xq, act, blocked)
    return out


SPLIT = 4  # column parts per value head in the folded step (a 128-wide head: 32 columns, 16 KB of state)
DEFAULT_CONFIG = (SPLIT, 4, 4)  # (column parts, warps of the column kernel, warps of the finish kernel)
