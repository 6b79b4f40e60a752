"""Paged decode attention, one query per sequence, and the store of new rows into a compressed K/V pool: picks
the Triton kernels or torch (SDPA over the gathered, decoded rows; the pool's own store)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hf2q.kernels.choose import triton_runs


def paged_decode_attention(q, k_rows, v_rows, block_tables, context_lens, block_size: int, scale: float,
                           gate=None, pool=None):
    """q: [B, nh, hd]; k_rows/v_rows: flat stored rows [rows, nkv, row] of `pool` (None: dense rows [rows, nkv,
    hd]); a compressed pool's rows are decoded as its `decode` does. Returns [B, nh, hd], times sigmoid(gate)
    ([B, nh, hd]) when given."""
    compressed = pool is not None and not pool.is_dense
    if triton_runs(q):
        from hf2q.kernels.attention.paged_triton import paged_decode_attention as kernel
        return kernel(q, k_rows, v_rows, block_tables, context_lens, block_size, scale, gate=gate,
                      kv_format=pool.format if compressed else None)
    longest = block_tables.shape[1] * block_size
    pos = torch.arange(longest, device=q.device)
    rows = block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    keys, values = k_rows[rows], v_rows[rows]  # [B, L, nkv, row]
    if compressed:
        keys, values = pool.decode(keys), pool.decode(values)
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    mask = (pos[None, :] < context_lens[:, None].long())[:, None, None, :]  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask, scale=scale, enable_gqa=True)[:, :, 0]
    return o if gate is None else o * torch.sigmoid(gate)


def store_compressed_kv(pool, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Encode K/V [T, nkv, hd] of new tokens into a compressed pool's layer at flat rows slot_mapping [T] (the
    Triton store where it runs, the pool's own `store` elsewhere)."""
    if triton_runs(k) and k.stride(-1) == 1 and v.stride(-1) == 1:
        from hf2q.kernels.attention.compressed_triton import store
        return store(pool.format, k, v, *pool.rows(layer), slot_mapping)
    pool.store(layer, slot_mapping, k, v)
