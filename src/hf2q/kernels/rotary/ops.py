"""Attention's q/k preparation (per-head RMSNorm, partial RoPE, the K/V write): picks the fused Triton
kernel or the references."""
from __future__ import annotations

from hf2q.forward import ForwardBatch
from hf2q.kernels.attention.ops import LayerKV, store_compressed_kv
from hf2q.kernels.choose import kernels_on, use_fast_path
from hf2q.kernels.meta import fast_meta
from hf2q.kernels.rotary import reference


def qk_norm_rope(q, k, v, q_w, k_w, cos, sin, eps: float, rotary_dim: int, pools=None):
    """Per-head RMSNorm and partial RoPE of q [T, nh, hd] and k [T, nkv, hd]; with pools (k_rows, v_rows,
    slot_mapping) also writes each token's K/V row into the paged pool. Returns (q, k)."""
    if kernels_on(q) and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:
        from hf2q.kernels.rotary.qk_rope_triton import qk_norm_rope as kernel
        return kernel(q, k, v, q_w, k_w, cos, sin, eps, rotary_dim, pools)
    q, k = reference.qk_norm_rope(q, k, q_w, k_w, cos, sin, eps, rotary_dim)
    if pools is not None:
        k_rows, v_rows, mapping = pools
        k_rows.index_copy_(0, mapping, k.to(k_rows.dtype))
        v_rows.index_copy_(0, mapping, v.to(v_rows.dtype))
    return q, k


def qk_norm_rope_store(q, k, v, q_w, k_w, cos, sin, eps: float, rotary_dim: int, batch: ForwardBatch,
                       kv: LayerKV | None):
    """qk_norm_rope, and the new tokens' K/V [T, nkv, hd] written into the layer's pool (kv None: no cache).
    The vectorised path (`use_fast_path`) writes through the batch's slot mapping: a model-dtype pool inside
    the q/k kernel, a compressed one by the store kernel after it; the exact path normalises and rotates in
    torch and stores each sequence's rows through its pool's own `store`. Returns (q, k)."""
    if not use_fast_path(q):
        q, k = reference.qk_norm_rope(q, k, q_w, k_w, cos, sin, eps, rotary_dim)
        if kv is not None:
            for _, row, n, start, slot in batch.segments():
                kv.pool.store(kv.index, kv.cache.token_indices(slot, start, start + n), k[row:row + n],
                              v[row:row + n])
        return q, k
    compressed = kv is not None and not kv.pool.is_dense
    pools = None if kv is None or compressed else (kv.k_rows, kv.v_rows, fast_meta(batch).slot_mapping)
    q, k = qk_norm_rope(q, k, v, q_w, k_w, cos, sin, eps, rotary_dim, pools)
    if compressed:
        store_compressed_kv(kv.pool, kv.index, fast_meta(batch).slot_mapping, k, v)
    return q, k
