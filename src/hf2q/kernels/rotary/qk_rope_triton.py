"""Triton q/k preparation of the gated attention: per-head RMSNorm of q and k, partial NeoX RoPE of the
first `rotary_dim` dims (pairs (p, p + rotary_dim/2), as `layers.rotary`), and, with a cache, the K/V
rows written straight into the paged pool.

One program per (token, head); heads [0, nh) are query heads (read from the q half of the fused
q+gate projection), heads [nh, nh + nkv) are key heads, which also copy their value head to the pool.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hf2q.kernels.tuning import pdl


@triton.jit
def _norm_rope(x_ptr, w_ptr, cos, sin, eps, HD: tl.constexpr, RD: tl.constexpr):
    dtype = x_ptr.dtype.element_ty  # round the norm as the unfused path does
    d = tl.arange(0, HD)
    half: tl.constexpr = RD // 2
    partner = tl.where(d < half, d + half, tl.where(d < RD, d - half, d))
    x = tl.load(x_ptr + d).to(tl.float32)
    xp = tl.load(x_ptr + partner).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / HD + eps)
    y = (x * inv * tl.load(w_ptr + d).to(tl.float32)).to(dtype).to(tl.float32)
    yp = (xp * inv * tl.load(w_ptr + partner).to(tl.float32)).to(dtype).to(tl.float32)
    yp = tl.where(d < half, -yp, yp)
    return tl.where(d < RD, y * cos + yp * sin, y)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, map_ptr, qo_ptr, ko_ptr,
                         kpool_ptr, vpool_ptr, NH, stride_qt, stride_qh, stride_kt, stride_vt, stride_cos,
                         stride_pool, eps, HD: tl.constexpr, RD: tl.constexpr, WRITE_POOL: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HD)
    rot = d < RD
    cos = tl.load(cos_ptr + t * stride_cos + d, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_cos + d, mask=rot, other=0.0).to(tl.float32)
    dtype = qo_ptr.dtype.element_ty
    if h < NH:
        y = _norm_rope(q_ptr + t * stride_qt + h * stride_qh, qw_ptr, cos, sin, eps, HD, RD)
        tl.store(qo_ptr + (t * NH + h) * HD + d, y.to(dtype))
    else:
        kh = h - NH
        nkv = tl.num_programs(1) - NH
        y = _norm_rope(k_ptr + t * stride_kt + kh * HD, kw_ptr, cos, sin, eps, HD, RD)
        tl.store(ko_ptr + (t * nkv + kh) * HD + d, y.to(dtype))
        if WRITE_POOL:
            row = tl.load(map_ptr + t).to(tl.int64)
            v = tl.load(v_ptr + t * stride_vt + kh * HD + d)
            tl.store(kpool_ptr + row * stride_pool + kh * HD + d, y.to(kpool_ptr.dtype.element_ty))
            tl.store(vpool_ptr + row * stride_pool + kh * HD + d, v.to(vpool_ptr.dtype.element_ty))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, rotary_dim: int,
                 pools: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, nh, hd], k/v: [T, nkv, hd] (strided views, last dim contiguous); cos/sin: [T, rotary_dim] fp32;
    pools: (k_rows, v_rows [rows, nkv, hd] contiguous, slot_mapping [T]) or None.
    Returns normed, rotated q [T, nh, hd] and k [T, nkv, hd], contiguous, in q's dtype."""
    t, nh, hd = q.shape
    nkv = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and k.stride(1) == hd and v.stride(2) == 1 and v.stride(1) == hd
    assert cos.stride(1) == 1 and cos.stride() == sin.stride()
    q_out = torch.empty(t, nh, hd, dtype=q.dtype, device=q.device)
    k_out = torch.empty(t, nkv, hd, dtype=q.dtype, device=q.device)
    if pools is not None:
        k_rows, v_rows, mapping = pools
        assert k_rows.is_contiguous() and v_rows.is_contiguous() and k_rows.shape[1:] == (nkv, hd)
    else:
        k_rows, v_rows, mapping = k_out, k_out, k_out
    _qk_norm_rope_kernel[(t, nh + nkv)](q, k, v, q_w, k_w, cos, sin, mapping, q_out, k_out, k_rows, v_rows, nh,
                                        q.stride(0), q.stride(1), k.stride(0), v.stride(0), cos.stride(0),
                                        nkv * hd, eps, HD=hd, RD=rotary_dim, WRITE_POOL=pools is not None,
                                        num_warps=2, **pdl.launch_options(q.device))
    return q_out, k_out
