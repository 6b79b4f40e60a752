"""Attention's q/k preparation (per-head RMSNorm, partial RoPE, the K/V write): picks the fused Triton
kernel or the references."""
from __future__ import annotations

from hf2q.kernels.choose import kernels_on
from hf2q.kernels.norm.reference import rms_norm
from hf2q.kernels.rotary.reference import apply_rotary


def qk_norm_rope(q, k, v, q_w, k_w, cos, sin, eps: float, rotary_dim: int, pools=None):
    """Per-head RMSNorm and partial RoPE of q [T, nh, hd] and k [T, nkv, hd]; with pools (k_rows, v_rows,
    slot_mapping) also writes each token's K/V row into the paged pool. Returns (q, k)."""
    if kernels_on(q) and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:
        from hf2q.kernels.rotary.qk_rope_triton import qk_norm_rope as kernel
        return kernel(q, k, v, q_w, k_w, cos, sin, eps, rotary_dim, pools)
    q = apply_rotary(rms_norm(q, q_w, eps), cos, sin, rotary_dim)
    k = apply_rotary(rms_norm(k, k_w, eps), cos, sin, rotary_dim)
    if pools is not None:
        k_rows, v_rows, mapping = pools
        k_rows.index_copy_(0, mapping, k.to(k_rows.dtype))
        v_rows.index_copy_(0, mapping, v.to(v_rows.dtype))
    return q, k
