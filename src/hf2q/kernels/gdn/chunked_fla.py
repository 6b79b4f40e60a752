"""Gated DeltaNet over many tokens (prefill, chunked prefill) through fla's chunked Triton kernel.

Sequences are laid end to end and separated by `cu_seqlens`; each starts from its slot's state and its
final state is returned for the caller to scatter back. fla groups value heads as h // (n_v / n_k);
GGUF files tile them (h % n_k), so q and k are expanded to n_v heads in tiled order first.
"""
from __future__ import annotations

import torch


def chunk_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [T, nk, dk] raw (L2-normalised in the kernel); v: [T, nv, dv]; g: [T, nv] log-decay fp32;
    beta: [T, nv] fp32; initial_state: [N, nv, dk, dv] fp32; cu_seqlens: [N + 1] int64.
    Returns (o [T, nv, dv], final state [N, nv, dk, dv] fp32)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    rep = v.shape[1] // q.shape[1]
    if rep > 1:
        q, k = q.repeat(1, rep, 1), k.repeat(1, rep, 1)
    o, final = chunk_gated_delta_rule(
        q.unsqueeze(0).contiguous(), k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous(),
        g.unsqueeze(0).contiguous(), beta.unsqueeze(0).to(q.dtype).contiguous(), scale=scale,
        initial_state=initial_state.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens)
    return o[0], final
