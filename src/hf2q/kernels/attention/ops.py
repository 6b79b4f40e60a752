"""Paged decode attention, one query per sequence: picks the Triton kernel or torch's SDPA over the
gathered rows."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hf2q.kernels.choose import triton_runs


def paged_decode_attention(q, k_rows, v_rows, block_tables, context_lens, block_size: int, scale: float,
                           gate=None):
    """q: [B, nh, hd]; k_rows/v_rows: flat pools [rows, nkv, hd]. Returns [B, nh, hd], times sigmoid(gate)
    ([B, nh, hd]) when given."""
    if triton_runs(q):
        from hf2q.kernels.attention.paged_triton import paged_decode_attention as kernel
        return kernel(q, k_rows, v_rows, block_tables, context_lens, block_size, scale, gate=gate)
    longest = block_tables.shape[1] * block_size
    pos = torch.arange(longest, device=q.device)
    rows = block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    keys, values = k_rows[rows].to(q.dtype), v_rows[rows].to(q.dtype)  # [B, L, nkv, hd]
    mask = (pos[None, :] < context_lens[:, None].long())[:, None, None, :]  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask, scale=scale, enable_gqa=True)[:, :, 0]
    return o if gate is None else o * torch.sigmoid(gate)
